"""Records real bundles from a compose stack: `python -m tests.unit.doctor.bundles.record_real` (repo root).

recorded_healthy.log  — `docker compose logs --timestamps` after 3 streamed requests (v2 prefixes)
recorded_kv_port.log  — the same after decode was recreated with kv_port 9200 and 1 more request
Both are what our services really printed (the scenario bundles, tests/unit/doctor/scenarios.py, add skew and garbage).
"""

from __future__ import annotations

from pathlib import Path

import openai

from tests.integration.compose_stack import compose_run, ensure_image, start_stack, unique_project
from tests.integration.doctor_helpers import MODEL, PROMPT, wait_backends_up

HERE = Path(__file__).parent


def _send(stack, rid: str) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key=stack.api_key, max_retries=0, timeout=60)
    try:
        for _ in client.chat.completions.create(model=MODEL, messages=PROMPT, stream=True, max_tokens=6,
                                                stream_options={"include_usage": True},
                                                extra_headers={"X-Request-ID": rid}):
            pass
    except openai.APIError as exc:
        print(f"{rid}: {exc}")


def _dump(stack, name: str) -> None:
    text = compose_run(stack.files, stack.env_file, ["logs", "--no-color", "--timestamps"]).stdout
    assert stack.api_key not in text, "the key must never reach a log"
    (HERE / name).write_text(text, encoding="utf-8")


def main() -> None:
    ensure_image()
    stack = start_stack(unique_project("pdt-doctor-rec"))
    try:
        for n in range(3):
            _send(stack, f"rec-healthy-{n}")
        _dump(stack, "recorded_healthy.log")
        compose_run((*stack.files, "tests/integration/scenarios/doctor_kv_port.yaml"), stack.env_file,
                    ["up", "-d", "--wait", "--no-deps", "decode"])
        wait_backends_up(stack)
        _send(stack, "rec-kvport-0")
        _dump(stack, "recorded_kv_port.log")
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
