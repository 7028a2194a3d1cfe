"""Rewards that scale: a batched function, a thread pool and a reward service over HTTP give the plain function's
rewards and trained policy (1 and 2 ranks); a service that fails or hangs, a batched function that loses a value
and a module that does not import each end in one line."""
from __future__ import annotations

import http.server
import json
import threading
import time

import pytest
import torch
from conftest import REPO, assert_same_update, run_script
from rewards_for_tests import echoes
from test_grpo import grpo_args, grpo_assets  # noqa: F401  (a fixture)

from nanochat_ext.ddp_common import free_port
from nanochat_ext.models.loader import load_backbone
from scripts import kat_train_grpo


class RewardService:
    """A reward service on 127.0.0.1 (a free port), started and stopped by the test: echoes of each
    completion, or a 500, or an answer slower than any timeout the test sets."""

    def __init__(self, mode: str = "ok"):
        service = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                service.calls += 1
                if mode == "hang":
                    time.sleep(3)
                if mode == "error":
                    self.send_error(500, "the judge fell over")
                    return
                rewards = [echoes(p, c, r) for p, c, r in zip(body["prompts"], body["completions"], body["rows"])]
                data = json.dumps({"rewards": rewards}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # quiet
                pass

        self.calls = 0
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.handle_error = lambda request, address: None  # a hung request's client is gone: no traceback
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


COMMON = ("--max_steps", "2", "--batch_size", "4", "--group_size", "4", "--beta", "0", "--val_ratio", "0",
          "--log_rollouts", "--lr", "1e-3")


def run(assets, grpo_assets, out, *reward) -> tuple[list[dict], dict]:
    assert kat_train_grpo.main(grpo_args(assets, grpo_assets, out, *COMMON, *reward)) == 0
    rollouts = [json.loads(line) for line in (out / "logs" / "rollouts.jsonl").read_text().splitlines()]
    return rollouts, load_backbone(out).model.state_dict()


def test_batched_threaded_and_remote_rewards_train_as_the_plain_function(assets, grpo_assets, tmp_path):
    plain = run(assets, grpo_assets, tmp_path / "plain", "--reward_fn", "rewards_for_tests:echoes")
    with RewardService() as service:
        variants = {
            "batched": ("--reward_fn", "rewards_for_tests:echoes_batched"),
            "threads": ("--reward_fn", "rewards_for_tests:echoes", "--reward_workers", "4"),
            "url": ("--reward_url", service.url),
        }
        for name, flags in variants.items():
            rollouts, weights = run(assets, grpo_assets, tmp_path / name, *flags)
            assert [(r["completion_ids"], r["reward"]) for r in rollouts] == \
                [(r["completion_ids"], r["reward"]) for r in plain[0]], name
            for key, w in plain[1].items():
                torch.testing.assert_close(weights[key], w, atol=0, rtol=0, msg=f"{name} {key}")
        assert service.calls == 2  # one POST per step from the one rank


def test_a_reward_service_on_two_ranks_gives_one_ranks_plain_rewards(assets, grpo_assets, tmp_path):
    plain = run(assets, grpo_assets, tmp_path / "plain", "--reward_fn", "rewards_for_tests:echoes")
    with RewardService() as service:
        out = tmp_path / "url2"
        args = grpo_args(assets, grpo_assets, out, *COMMON, "--reward_url", service.url)
        proc = run_script("scripts.kat_train_grpo", args, nproc=2, env={"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert service.calls == 4  # each rank, each step
    rollouts = [json.loads(line) for line in (out / "logs" / "rollouts.jsonl").read_text().splitlines()]
    assert [(r["completion_ids"], r["reward"]) for r in rollouts] == [(r["completion_ids"], r["reward"])
                                                                      for r in plain[0]]
    assert_same_update(load_backbone(out).model.state_dict(), plain[1], load_backbone(assets["gpt"]).model.state_dict())


@pytest.mark.parametrize("mode,expected", [
    ("error", "failed 3 times (timeout 1 s): HTTP 500 the judge fell over"),
    ("hang", "failed 3 times (timeout 1 s): "),
    ("refused", "failed 3 times (timeout 1 s): [Errno 111] Connection refused"),
])
def test_a_reward_service_that_fails_hangs_or_refuses_ends_in_one_line(assets, grpo_assets, tmp_path, capsys, mode,
                                                                       expected):
    """Three tries, 1 s then 2 s apart (each of a hung service after its 1 s timeout), then one line naming the URL
    and the last failure."""
    with RewardService(mode) as service:
        url = service.url if mode != "refused" else f"http://127.0.0.1:{free_port()}/score"  # nothing listens there
        t0 = time.time()
        assert kat_train_grpo.main(grpo_args(assets, grpo_assets, tmp_path / "out", "--max_steps", "1", "--beta", "0",
                                             "--reward_url", url, "--reward_timeout", "1")) == 2
        waited = time.time() - t0
        assert service.calls == (0 if mode == "refused" else 3)
    backoff = 1 + 2 + (3 * 1 if mode == "hang" else 0)  # the sleeps between tries, and a hung service's timeouts
    assert backoff <= waited < backoff + 20, waited
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--reward_url {url} {expected}" in err, err


@pytest.mark.parametrize("url", ["localhost:8000/score", "ftp://127.0.0.1/score", "http:///score"])
def test_a_reward_url_that_is_not_http_is_refused_before_anything_runs(assets, grpo_assets, tmp_path, capsys, url):
    assert kat_train_grpo.main(grpo_args(assets, grpo_assets, tmp_path / "out", "--reward_url", url)) == 2
    assert capsys.readouterr().err.strip() == f"error: --reward_url must be an http:// or https:// URL, got {url!r}"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("spec,expected", [
    ("rewards_for_tests:batched_short", "prompts.jsonl:70 and 7 more returned list of 63 values for 64 "
                                        "completions"),  # the step's first prompt as its file numbers it
    ("broken_reward_module:anything", "cannot import 'broken_reward_module' (SyntaxError"),
])
def test_a_batched_function_that_loses_a_value_or_a_module_that_does_not_parse(assets, grpo_assets, tmp_path,
                                                                             capsys, monkeypatch, spec, expected):
    (tmp_path / "broken_reward_module.py").write_text("def anything(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert kat_train_grpo.main(grpo_args(assets, grpo_assets, tmp_path / "out", "--max_steps", "1", "--beta", "0",
                                         "--reward_fn", spec)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "out").exists() or spec.endswith("batched_short")
