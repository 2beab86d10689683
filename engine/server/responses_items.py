"""The output items of a Response (reasoning, message, function_call) and the stream events that build them.

A streamed response adds its items one after the other, each opened (`response.output_item.added`, and for
text a `response.content_part.added`), grown by deltas, then closed with the `.done` events that repeat the
whole text. The items are built here once: the events carry copies, and the final `response.completed` holds
the same items with the same ids, as the openai SDK's stream accumulator checks.
"""
from __future__ import annotations

import copy
import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": [_output_text(text)]}


def function_call_item(name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": new_id("fc"), "call_id": new_id("call"), "name": name,
            "arguments": arguments, "status": status}


def _output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class OutputEvents:
    """The items of one streamed response and the events that report them, in order."""

    def __init__(self):
        self.items: list[dict] = []
        self.calls: dict[int, int] = {}        # the tool parser's call index -> output index
        self._open: int | None = None          # the output index of the item being streamed

    def reasoning(self, delta: str) -> list[dict]:
        events = self._ensure_open("reasoning", lambda: reasoning_item("", "in_progress"))
        return events + self._grow_text(delta, "response.reasoning_text.delta")

    def text(self, delta: str) -> list[dict]:
        events = self._ensure_open("message", lambda: message_item("", "in_progress"))
        return events + (self._grow_text(delta, "response.output_text.delta", logprobs=[]) if delta else [])

    def tool_call(self, delta: dict) -> list[dict]:
        """One delta of the hermes tool parser: a call's start (with its name) or a piece of its arguments."""
        events = []
        if delta["index"] not in self.calls:
            events = self._add(function_call_item(delta["function"]["name"], "", "in_progress"))
            self.calls[delta["index"]] = self._open
        piece = delta["function"].get("arguments")
        if piece:
            index = self.calls[delta["index"]]
            self.items[index]["arguments"] += piece
            events.append({"type": "response.function_call_arguments.delta", "item_id": self.items[index]["id"],
                           "output_index": index, "delta": piece})
        return events

    def close(self, status: str) -> list[dict]:
        """The `.done` events of the item being streamed; `status`: completed, or incomplete (cut short)."""
        if self._open is None:
            return []
        index, item = self._open, self.items[self._open]
        self._open = None
        item["status"] = status
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            events = [{"type": "response.function_call_arguments.done", **where, "name": item["name"],
                       "arguments": item["arguments"]}]
        else:
            part = item["content"][0]
            done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            extra = {} if item["type"] == "reasoning" else {"logprobs": []}
            events = [{"type": done, **where, "content_index": 0, "text": part["text"], **extra},
                      {"type": "response.content_part.done", **where, "content_index": 0, "part": copy.deepcopy(part)}]
        return events + [{"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)}]

    def _ensure_open(self, kind: str, make) -> list[dict]:
        if self._open is not None and self.items[self._open]["type"] == kind:
            return []
        return self._add(make())

    def _add(self, item: dict) -> list[dict]:
        events = self.close("completed")
        self.items.append(item)
        self._open = index = len(self.items) - 1
        opened = copy.deepcopy(item)
        if "content" in opened:
            part, opened["content"] = opened["content"][0], []
        events.append({"type": "response.output_item.added", "output_index": index, "item": opened})
        if "content" in item:
            events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "part": part})
        return events

    def _grow_text(self, delta: str, event: str, **extra) -> list[dict]:
        index = self._open
        item = self.items[index]
        item["content"][0]["text"] += delta
        return [{"type": event, "item_id": item["id"], "output_index": index, "content_index": 0, "delta": delta,
                 **extra}]
