"""Scale's `llmengine` client, unchanged, driven from the command line: run with the
client's own environment (.venv-llmengine, made by scripts/scale-client.sh), with
`LLM_ENGINE_BASE_PATH` and `SCALE_API_KEY` set as its users set them. Imports nothing of
llmq's. `argv[1]` is one call as JSON; what the client returns is printed as JSON."""

from __future__ import annotations

import json
import sys
from typing import Any

from llmengine import Completion
from llmengine.data_types.batch_completion import (
    CreateBatchCompletionsV2ModelConfig,
    FilteredChatCompletionV2Request,
    FilteredCompletionV2Request,
)


def item(fields: dict[str, Any]) -> Any:
    kind = FilteredChatCompletionV2Request if "messages" in fields else FilteredCompletionV2Request
    return kind(**fields)


def main() -> None:
    call = json.loads(sys.argv[1])
    if call["call"] == "batch_create":
        job = Completion.batch_create(
            output_data_path=call["output_data_path"],
            model_config=CreateBatchCompletionsV2ModelConfig(model=call["model"]),
            content=[item(x) for x in call["content"]] if call.get("content") else None,
            input_data_path=call.get("input_data_path"),
            labels=call["labels"],
            max_runtime_sec=call.get("max_runtime_sec", 24 * 3600),
            use_v2=True,
        )
        print(job.json())
    elif call["call"] == "get":
        print(json.dumps(Completion.get_batch_completion(call["job_id"])))
    elif call["call"] == "cancel":
        print(json.dumps(Completion.cancel_batch_completion(call["job_id"])))
    else:
        raise SystemExit(f"unknown call {call['call']!r}")


if __name__ == "__main__":
    main()
