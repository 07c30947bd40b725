"""`phasescope run -- PROGRAM`: zero-code attach through the sitecustomize bootstrap.

An HF script (from_pretrained + generate) and the demo's workload (continuous batching)
print the same tokens with and without phasescope; with an agent, records arrive; with
none, the program's stdout and stderr are byte-identical to a run without phasescope."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

HF_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # its rate changes from run to run
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
    ids = torch.tensor([[5, 17, 42, 99, 7, 3], [8, 8, 9, 10, 11, 12]])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                             do_sample=False, pad_token_id=0)
    print(out[:, ids.shape[1]:].tolist())
    print("done", file=sys.stderr)
""")


def _run(argv: list[str], env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHASESCOPE_")}
    env.update(env_extra or {})
    return subprocess.run(argv, capture_output=True, env=env, timeout=300)


def _ps_run(agent: str, program: list[str], *extra: str) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "phasescope.cli", "run", "--agent", agent, *extra, "--", *program])


@pytest.fixture(scope="module")
def hf_model_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   pad_token_id=0, eos_token_id=None)
    d = tmp_path_factory.mktemp("hf-model")
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    script = d / "serve.py"
    script.write_text(HF_SCRIPT)
    return d


def _rows(sidecar, sql: str, run_id: str) -> int:
    con = sidecar.store.cursor()
    try:
        return con.execute(sql, [run_id]).fetchone()[0]
    finally:
        con.close()


STEPS = "SELECT count(*) FROM steps JOIN sources USING (source_id) WHERE run_id = ?"
EVENTS = "SELECT count(*) FROM request_events JOIN sources USING (source_id) WHERE run_id = ? AND event = 'finished'"
KV = "SELECT count(*) FROM kv_snapshots JOIN sources USING (source_id) WHERE run_id = ?"


@pytest.mark.slow
def test_hf_script_same_tokens_and_records_arrive(hf_model_dir, sidecar, short_tmp):
    program = [sys.executable, str(hf_model_dir / "serve.py"), str(hf_model_dir)]
    plain = _run(program)
    assert plain.returncode == 0, plain.stderr.decode()
    attached = _ps_run(f"unix:{short_tmp}/agent.sock", program, "--run-id", "hfscript", "--label", "case=hf")
    assert attached.returncode == 0, attached.stderr.decode()
    assert attached.stdout == plain.stdout
    assert sidecar.wait_rows(lambda: _rows(sidecar, EVENTS, "hfscript") == 2, 20)
    assert _rows(sidecar, STEPS, "hfscript") == 12  # one prefill + 11 decode forwards
    con = sidecar.store.cursor()
    labels = dict(con.execute("SELECT key, value FROM run_info WHERE run_id = 'hfscript'").fetchall())
    runtime = con.execute("SELECT DISTINCT runtime FROM sources WHERE run_id = 'hfscript'").fetchall()
    con.close()
    assert labels["case"] == "hf" and labels.get("model_layers") == "2"
    assert runtime == [("hf-generate",)]


@pytest.mark.slow
def test_hf_script_without_an_agent_is_byte_identical(hf_model_dir, short_tmp):
    program = [sys.executable, str(hf_model_dir / "serve.py"), str(hf_model_dir)]
    plain = _run(program)
    absent = _ps_run(f"unix:{short_tmp}/nobody-listens.sock", program)
    assert absent.returncode == plain.returncode == 0
    assert absent.stdout == plain.stdout
    assert absent.stderr == plain.stderr


@pytest.mark.slow
def test_demo_same_tokens_with_and_without_and_records_arrive(sidecar, short_tmp):
    program = [sys.executable, "-m", "phasescope.cli.serve_demo", "--requests", "6"]
    plain = _run(program)
    assert plain.returncode == 0, plain.stderr.decode()
    assert len(plain.stdout.splitlines()) == 6
    attached = _ps_run(f"unix:{short_tmp}/agent.sock", program, "--run-id", "demorun")
    assert attached.returncode == 0, attached.stderr.decode()
    assert attached.stdout == plain.stdout
    assert sidecar.wait_rows(lambda: _rows(sidecar, EVENTS, "demorun") == 6, 20)
    assert _rows(sidecar, STEPS, "demorun") > 0 and _rows(sidecar, KV, "demorun") > 0
    absent = _ps_run(f"unix:{short_tmp}/nobody-listens.sock", program)
    assert (absent.returncode, absent.stdout, absent.stderr) == (0, plain.stdout, plain.stderr)


def test_run_environment(monkeypatch):
    from phasescope.cli.deploy import bootstrap_dir, build_run_env

    env = build_run_env(agent="tcp:127.0.0.1:7701", run_id=None, labels=["a=1,b=2", "c=3"], no_cuda_timing=True,
                        environ={"PYTHONPATH": "/x", "PHASESCOPE_LABELS": "z=9"})
    assert env["PYTHONPATH"].split(os.pathsep) == [bootstrap_dir(), "/x"]
    assert env["PHASESCOPE_AGENT"] == "tcp:127.0.0.1:7701"
    assert env["PHASESCOPE_LABELS"] == "z=9,a=1,b=2,c=3"
    assert env["PHASESCOPE_CUDA_TIMING"] == "0" and len(env["PHASESCOPE_RUN_ID"]) == 12
    assert os.path.exists(os.path.join(bootstrap_dir(), "sitecustomize.py"))


def test_env_options_are_checked():
    from phasescope.agent.probe.autoattach import options_from_env, parse_labels

    assert options_from_env({"PHASESCOPE_AGENT": "unix:/s", "PHASESCOPE_RUN_ID": "r1", "PHASESCOPE_LABELS": "k=v",
                             "PHASESCOPE_CUDA_TIMING": "0"}) == \
        {"address": "unix:/s", "run_id": "r1", "labels": {"k": "v"}, "cuda_timing": False}
    with pytest.raises(ValueError):
        parse_labels("novalue")
    with pytest.raises(ValueError):
        options_from_env({"PHASESCOPE_CUDA_TIMING": "maybe"})


def test_run_without_a_program_is_an_error():
    r = _run([sys.executable, "-m", "phasescope.cli", "run"])
    assert r.returncode != 0 and b"give the program" in r.stderr
