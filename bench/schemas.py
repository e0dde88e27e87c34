"""Five JSON schemas and the prompts that ask for them: the structured-output phase and the
grammar-library comparison (``bench/grammar_libs.py``) share them."""
from __future__ import annotations

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "email": {"type": "string"}},
        "required": ["name", "age"], "additionalProperties": False},
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1},
            "customer": {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
                         "required": ["name", "city"], "additionalProperties": False},
            "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
                "type": "object", "properties": {"product": {"type": "string"},
                                                 "quantity": {"type": "integer", "minimum": 1, "maximum": 99}},
                "required": ["product", "quantity"], "additionalProperties": False}}},
        "required": ["id", "customer", "items"], "additionalProperties": False},
    "weather": {
        "type": "object",
        "properties": {"city": {"type": "string"},
                       "condition": {"enum": ["sunny", "cloudy", "rainy", "snowy", "windy"]},
                       "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
                       "humidity": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["city", "condition", "temperature_c", "humidity"], "additionalProperties": False},
    "recipe": {
        "type": "object",
        "properties": {"title": {"type": "string"},
                       "ingredients": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 8},
                       "minutes": {"type": "integer", "minimum": 1, "maximum": 600},
                       "vegetarian": {"type": "boolean"}},
        "required": ["title", "ingredients", "minutes", "vegetarian"], "additionalProperties": False},
    "review": {
        "type": "object",
        "properties": {"product": {"type": "string"}, "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                       "sentiment": {"enum": ["positive", "neutral", "negative"]},
                       "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
        "required": ["product", "rating", "sentiment"], "additionalProperties": False},
}

SUBJECTS = {
    "person": ["a famous painter", "a retired teacher", "a young chef", "an astronaut", "a village doctor",
               "a jazz musician", "a software engineer", "a marathon runner", "a librarian", "a fisherman"],
    "order": ["three books", "a laptop and a mouse", "garden tools", "coffee beans", "two pairs of shoes",
              "a bicycle", "kitchen knives", "printer paper", "a desk lamp", "winter clothes"],
    "weather": ["Paris", "Tokyo", "Cairo", "Oslo", "Lima", "Sydney", "Toronto", "Mumbai", "Berlin", "Nairobi"],
    "recipe": ["pancakes", "tomato soup", "a green salad", "fried rice", "banana bread", "lentil curry",
               "pizza", "guacamole", "omelette", "apple pie"],
    "review": ["a phone", "a pair of headphones", "a novel", "a hotel", "a restaurant", "a vacuum cleaner",
               "a board game", "a movie", "a coffee maker", "running shoes"],
}

# One valid instance per schema: the grammar-library comparison walks its tokens.
EXAMPLES = {
    "person": {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"},
    "order": {"id": 17, "customer": {"name": "Sam", "city": "Lyon"},
              "items": [{"product": "notebook", "quantity": 3}, {"product": "pen", "quantity": 10}]},
    "weather": {"city": "Oslo", "condition": "snowy", "temperature_c": -4.5, "humidity": 81},
    "recipe": {"title": "Pancakes", "ingredients": ["flour", "milk", "eggs"], "minutes": 20, "vegetarian": True},
    "review": {"product": "Headphones", "rating": 4, "sentiment": "positive", "tags": ["comfort", "bass"]},
}


def prompts() -> list[tuple[str, str]]:
    """(schema name, user message): 10 per schema, 50 in all."""
    out = []
    for name, subjects in SUBJECTS.items():
        fields = ", ".join(SCHEMAS[name]["properties"])
        for subject in subjects:
            out.append((name, f"Describe {subject} as a JSON object with the fields {fields}. "
                              "Answer with the JSON object only."))
    return out
