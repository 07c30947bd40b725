"""Start vLLM (in-process offline engine, random-weight tiny Llama) with command-line flags, as a user would pass them.

Run with the vLLM venv's python (VLLM_ENABLE_V1_MULTIPROCESSING=0: one process, vLLM imported once, so
each flag set costs an engine start, not an import). Each flag set goes through vLLM's own parser
(`EngineArgs.add_cli_args`, `EngineArgs.from_cli_args`), the engine is built and serves one request
of one token: a refused flag (parser, config check, backend block sizes, KV allocation) fails it.
Prints one line per flag set, then the flags vLLM's parser does not know:
    PHASESCOPE_START {"flags": [...], "ok": true|false, "error": "..."}
    PHASESCOPE_UNKNOWN [...]
Usage:
    python start_with_flags.py MODEL_DIR JOB.json     # {"sets": [[FLAG, VALUE, ...], ...], "known": [FLAG, ...]}
`known`: flags advice names without a value; each must exist in `vllm serve`'s parser (engine and server flags).
"""

from __future__ import annotations

import gc
import json
import os
import sys


def start(parser, model: str, flags: list[str]) -> dict:
    out: dict = {"flags": flags, "ok": False, "error": ""}
    engine = None
    try:
        from vllm import SamplingParams
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        base = ["--model", model, "--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager",
                "--dtype", "float32"]
        engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(parser.parse_args(base + flags)))
        engine.add_request("0", {"prompt_token_ids": [1, 2, 3, 4]}, SamplingParams(max_tokens=1, ignore_eos=True))
        done = 0
        for _ in range(100):
            done += sum(int(o.finished) for o in engine.step())
            if not engine.has_unfinished_requests():
                break
        out["ok"] = done == 1
        out["error"] = "" if out["ok"] else "the request did not finish"
    except SystemExit as exc:  # argparse refuses a flag or value
        out["error"] = f"argument error (exit {exc.code})"
    except Exception as exc:  # noqa: BLE001 - reported, the test decides
        out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        if engine is not None:
            try:
                engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001
                pass
        del engine
        gc.collect()
    return out


def main() -> None:
    model, job_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(exit_on_error=False))
    # flags named without a value may be the server's (`vllm serve`: --api-server-count): its whole parser
    from vllm.entrypoints.launchers.cli_args import make_arg_parser

    server = make_arg_parser(FlexibleArgumentParser())
    options = {s for a in server._actions for s in a.option_strings}
    for flags in job["sets"]:
        print("PHASESCOPE_START " + json.dumps(start(parser, model, flags)), flush=True)
    print("PHASESCOPE_UNKNOWN " + json.dumps([f for f in job.get("known", []) if f not in options]), flush=True)
    os._exit(0)  # do not wait on an orderly shutdown of what the engines left


if __name__ == "__main__":
    main()
