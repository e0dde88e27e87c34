"""``chat.runs.RunRegistry`` kept in this process: its own runs, and the conversations they answer."""
from __future__ import annotations

from ..runs import Run


class LocalRuns:
    """Every run of this worker by (client, request id), and which conversations are busy."""

    def __init__(self) -> None:
        self.by_id: dict[tuple[str, str], Run] = {}
        self.claims: dict[str, tuple[str, str]] = {}  # conversation -> (client, rid) answering it

    def get(self, client: str, rid: str) -> Run | None:
        """The run ``rid`` of ``client`` (active, or ended within the resume grace), or None."""
        return self.by_id.get((client, rid))

    def active(self, client: str, rid: str) -> bool:
        """Whether ``rid`` of ``client`` is still answering."""
        run = self.by_id.get((client, rid))
        return run is not None and not run.finished

    def busy(self, conversation_id: str) -> bool:
        """Whether a request is answering in the conversation."""
        return conversation_id in self.claims

    def claim(self, conversation_id: str, client: str, rid: str) -> bool:
        """Mark the conversation busy for this request; False when another request has it."""
        if conversation_id in self.claims:
            return False
        self.claims[conversation_id] = (client, rid)
        return True

    def unclaim(self, conversation_id: str, client: str, rid: str) -> None:
        """Free the conversation if this request holds it."""
        if self.claims.get(conversation_id) == (client, rid):
            del self.claims[conversation_id]

    def add(self, run: Run) -> None:
        """Register a run this worker just started."""
        self.by_id[(run.client, run.id)] = run

    def release(self, run: Run) -> None:
        """The run ended: its conversation is free (the run stays resumable until ``forget``)."""
        self.unclaim(run.conversation_id, run.client, run.id)

    def forget(self, run: Run) -> None:
        """The resume grace is over: the run is gone."""
        if self.by_id.get((run.client, run.id)) is run:
            del self.by_id[(run.client, run.id)]

    def followed(self, run: Run) -> bool:
        """No other worker can follow a run here."""
        return False

    def all_active(self) -> list[Run]:
        """This worker's runs still answering."""
        return [r for r in list(self.by_id.values()) if not r.finished]

    def answering(self, client: str | None, conversation_id: str) -> dict | None:
        """The run answering in ``client``'s conversation, or None (also another client's)."""
        holder = self.claims.get(conversation_id)
        run = self.by_id.get(holder) if holder is not None and holder[0] == client else None
        if run is None or run.finished:
            return None
        return {"id": run.id, "message_id": run.message_id, "prefix_chars": len(run.prefix)}

    def answering_in(self, client: str | None, conversation_ids: list[str]) -> set[str]:
        """Which of ``client``'s conversations a request of it is answering in now."""
        return {c for c in conversation_ids if (self.claims.get(c) or ("",))[0] == client}
