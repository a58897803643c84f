"""The order in which the feeder sends a batch's lines: the one place that states it.

Rule: within a tenant, waiting lines go in priority order, then earliest deadline first,
then batch by batch; within a batch, lines whose prompts begin alike go together (by their
prefix key), then in line order. Lines that share a system prompt or a few-shot block thus
run close together, and vLLM's prefix cache computes that prefix once for many of them
instead of once per line after it was evicted. The output file keeps input order whatever
the run order (it is read by line number), so ordering is invisible but for speed.

A batch created with `x_line_order: "input"` opts out: its lines get no key and go in
line order. (With the OpenAI SDK: `client.batches.create(..., extra_body={"x_line_order":
"input"})`.)

The prefix key is computed once, when the lines become jobs (app/services/batch_transitions.py),
from what the chat template renders before the last message: the tools, then each leading
message (all but the last, at most `KEY_MESSAGES` of them). Each part contributes the first
8 hex digits of its md5, so the key sorts hierarchically: lines sharing the system prompt
are contiguous, and within them those sharing the next message too. A line with a single
message has only the tools part, so such lines keep line order among themselves.
"""

from __future__ import annotations

from enum import StrEnum


class LineOrder(StrEnum):
    PREFIX = "prefix"  # lines sharing a prompt prefix run together (the default)
    INPUT = "input"  # the input file's order


KEY_MESSAGES = 16

# SQL over `b`, a line's request body (json): its prefix key, or NULL when :prefix_order is
# false. `json` (not jsonb) keeps each message's text as uploaded, so equal messages written
# the same way hash the same. Each `json` operator parses its text again, so the messages are
# walked once: the first KEY_MESSAGES + 1 are hashed and the last part is cut off (all but
# the last message, at most KEY_MESSAGES). About 35 µs a line on the 2-core machine.
PREFIX_KEY_SQL = f"""
    CASE WHEN :prefix_order THEN
      left(md5(coalesce((b->'tools')::text, '')), 8) || coalesce((
        SELECT left(string_agg(left(md5(m::text), 8), '' ORDER BY i),
                    8 * least(count(*)::int - 1, {KEY_MESSAGES}))
        FROM json_array_elements(CASE WHEN json_typeof(b->'messages') = 'array' THEN b->'messages' END)
             WITH ORDINALITY AS e(m, i)
        WHERE i <= {KEY_MESSAGES + 1}), '')
    END
"""  # noqa: S608 - KEY_MESSAGES is a constant


def prefix_order(line_order: str) -> bool:
    return line_order != LineOrder.INPUT.value
