"""Key/value storage: the batch's buffer, the prefix cache kept between turns, and its copy on disk."""
