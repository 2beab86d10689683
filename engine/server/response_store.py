"""Responses kept for `previous_response_id` and GET /v1/responses/{id}: in memory, bounded in count and bytes,
the oldest dropped first (a request naming a dropped one gets a 404 that says so)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine.server.errors import NotFoundError, dumps

MAX_STORED_RESPONSES = 1000
MAX_STORED_BYTES = 256 * 1024 * 1024     # images travel inside the messages as data URLs


@dataclass(frozen=True)
class StoredResponse:
    response: dict            # the Response object as it was returned
    messages: list[dict]      # the whole conversation as chat messages, its output included (no instructions)
    size: int                 # bytes, as JSON


class ResponseStore:
    def __init__(self, max_count: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES):
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict, messages: list[dict]) -> None:
        size = len(dumps(response)) + len(dumps(messages))
        if size > self.max_bytes:
            return                                        # larger than the whole store: not kept
        self.pop(response["id"])
        self._items[response["id"]] = StoredResponse(response, messages, size)
        self.bytes += size
        while len(self._items) > self.max_count or self.bytes > self.max_bytes:
            _, dropped = self._items.popitem(last=False)
            self.bytes -= dropped.size

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        stored = self._items.get(response_id)
        if stored is None:
            raise NotFoundError(f"no stored response {response_id!r}: it was never stored (store: false), was "
                                f"deleted, or was dropped to keep the store within {self.max_count} responses "
                                f"and {self.max_bytes // 2 ** 20} MiB", param=param, code="response_not_found")
        self._items.move_to_end(response_id)             # a conversation in use stays
        return stored

    def pop(self, response_id: str) -> StoredResponse | None:
        stored = self._items.pop(response_id, None)
        if stored is not None:
            self.bytes -= stored.size
        return stored
