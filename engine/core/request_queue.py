"""The scheduler's queues of requests that wait for the GPU (waiting, swapped out), as in vLLM v1: kept in policy
order as requests enter, so that a step reads only the heads it admits, however many requests wait.

Policy order: fcfs by arrival time; priority by `priority` value (lower runs sooner), then arrival time. Requests
of equal rank keep the order they entered in, except that one put back at the front (prepend_request: a request
preempted for recompute) goes before them.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Container, Iterator
from operator import attrgetter

from engine.core.request import Request

# (policy key, place among requests of equal key, the request); places are unique, so requests are never compared.
QueueEntry = tuple[object, int, Request]


class RequestQueue:
    """A binary heap of entries: the head in O(1), adding or taking it in O(log n)."""

    key: Callable[[Request], object]         # the policy's rank of a request: lower goes first

    def __init__(self) -> None:
        self._heap: list[QueueEntry] = []
        self._entered = itertools.count(1)

    def add_request(self, request: Request) -> None:
        """Behind the requests of equal rank."""
        self.push_entry((self.key(request), next(self._entered), request))

    def prepend_request(self, request: Request) -> None:
        """Ahead of the requests of equal rank."""
        self.push_entry((self.key(request), -next(self._entered), request))

    def peek_request(self) -> Request:
        return self._heap[0][2]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def pop_entry(self) -> QueueEntry:
        """The head with its place: push_entry puts it back exactly there (a request passed over for a step)."""
        return heapq.heappop(self._heap)

    def push_entry(self, entry: QueueEntry) -> None:
        heapq.heappush(self._heap, entry)

    def remove_requests(self, request_ids: Container[str]) -> None:
        """Take out every request named, in one pass over the queue however many there are (a burst of aborts).
        A new list, so that a reader on another thread iterating the old one never sees it change."""
        heap = [entry for entry in self._heap if entry[2].request_id not in request_ids]
        heapq.heapify(heap)
        self._heap = heap

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In policy order (a sorted copy: for tests, stats and the block map, never the step)."""
        return (entry[2] for entry in sorted(self._heap))


class FCFSRequestQueue(RequestQueue):
    key = attrgetter("arrival_time")


class PriorityRequestQueue(RequestQueue):
    key = attrgetter("priority", "arrival_time")


def create_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', not {policy!r}")
