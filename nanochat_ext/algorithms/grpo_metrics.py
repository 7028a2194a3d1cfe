"""GRPO's logged metrics, each declared once: its name, the log window's sums it reads and its formula over them.
The window's sums (WINDOW) are those the metrics read; a step adds to them on every rank and the loop sums them over
ranks once a window (training/tracking.py's WindowSums).

Times are summed over ranks and every rank counts its steps, so per-step seconds divide by the step count (which is
world x steps). Throughput is over the wall clock, so work between the timed phases counts too.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    """One log window: its sums over all ranks (`s`), the world size, its wall-clock seconds, the device's peak
    bandwidth (None: unknown), the reward names, whether rollouts ran ahead (--async_rollouts)."""
    s: dict[str, float]
    world: int
    elapsed: float
    peak_bw: float | None = None
    rewards: tuple[str, ...] = ()
    async_rollouts: bool = False

    @property
    def completions(self) -> float:
        return self.s["samples"]

    @property
    def steps(self) -> float:  # every rank counted each step
        return self.s["steps"] / self.world

    @property
    def scored(self) -> float:  # the rewards' means leave out what the machine failed to score (errors.Unscored)
        return max(self.s["samples"] - self.s["sandbox_failures"], 1)

    @property
    def loss_tokens(self) -> float:
        return max(self.s["loss_tokens"], 1)

    def per_step(self, phase: str) -> float:  # seconds per step, mean over ranks
        return self.s[f"{phase}_s"] / (self.steps * self.world)


@dataclass(frozen=True)
class Metric:
    """A logged metric: the window sums its formula reads, and where it is logged (`when`; always by default).
    per_reward: one for each reward, `name` formatted with the reward's name and the formula given it too."""
    name: str
    sums: tuple[str, ...]
    formula: Callable[..., float]
    when: Callable[[Window], bool] = lambda w: True
    per_reward: bool = False


def _mean_reward(w: Window) -> float:
    return w.s["reward"] / w.scored


def _reward_std(w: Window) -> float:
    return max(w.s["reward_sq"] / w.scored - _mean_reward(w) ** 2, 0.0) ** 0.5


def _rewarded(w: Window) -> bool:  # none: distillation alone
    return bool(w.rewards)


def _per_completion(total: str) -> Callable[[Window], float]:
    return lambda w: w.s[total] / w.completions


def _per_loss_token(total: str) -> Callable[[Window], float]:
    return lambda w: w.s[total] / w.loss_tokens


def _per_engine_token(total: str) -> Callable[[Window], float]:
    return lambda w: w.s[total] / w.s["engine_tokens"]


def _engine_compared(w: Window) -> bool:  # the trainer's first-update log-probs against the engine's
    return bool(w.s["engine_tokens"])


def _per_tool_call(total: str) -> Callable[[Window], float]:
    return lambda w: w.s[total] / max(w.s["tool_calls"], 1)


COUNTS = ("samples", "sandbox_failures", "steps", "loss_tokens")  # what Window's properties read
METRICS: tuple[Metric, ...] = (
    Metric("train/reward", ("reward",), _mean_reward, _rewarded),
    Metric("train/reward_std", ("reward", "reward_sq"), _reward_std, _rewarded),
    # each reward's mean, from its own sum (reward_<name>, which the window holds beside WINDOW)
    Metric("train/reward_{}", (), lambda w, reward: w.s[f"reward_{reward}"] / w.scored, per_reward=True),
    # completions unscored (errors.Unscored): out of the loss
    Metric("train/sandbox_failures", (), _per_completion("sandbox_failures")),
    Metric("train/loss", ("loss",), lambda w: w.s["loss"] / w.steps),
    # chat_rl's printed loss, -sum(A logp) / N, normalised as train/loss (grpo_loss)
    Metric("train/pg_objective", ("pg_objective",), lambda w: w.s["pg_objective"] / w.steps),
    Metric("train/kl", ("kl",), _per_loss_token("kl")),
    Metric("train/entropy", ("entropy",), _per_loss_token("entropy")),
    Metric("train/clip_frac", ("clipped",), _per_loss_token("clipped")),
    Metric("train/completion_len", ("sampled_tokens",), _per_completion("sampled_tokens")),
    # --tools and --env: tool calls per completion and the share refused or failed (and timed out), assistant turns
    # and failed (and timed-out) environment calls per completion, the calls still running past their timeout per
    # rank, and the tokens forced in per completion (in gen_tokens_per_s, the decoding's work, but not in the
    # completion length the loss sees)
    Metric("train/tool_calls", ("tool_calls",), _per_completion("tool_calls")),
    Metric("train/tool_errors", ("tool_errors", "tool_calls"), _per_tool_call("tool_errors")),
    Metric("train/tool_timeouts", ("tool_timeouts", "tool_calls"), _per_tool_call("tool_timeouts")),
    Metric("train/turns", ("turns",), _per_completion("turns")),
    Metric("train/env_errors", ("env_errors",), _per_completion("env_errors")),
    Metric("train/env_timeouts", ("env_timeouts",), _per_completion("env_timeouts")),
    Metric("train/late_calls", ("late_calls", "draws"), lambda w: w.s["late_calls"] / (w.s["draws"] * w.world)),
    Metric("train/forced_tokens", ("tokens", "sampled_tokens"),
           lambda w: (w.s["tokens"] - w.s["sampled_tokens"]) / w.completions),
    Metric("train/truncated_frac", ("truncated",), _per_completion("truncated")),
    Metric("train/rm_truncated_frac", ("rm_cut",), _per_completion("rm_cut")),
    Metric("train/zero_std_groups", ("zero_std", "groups"), lambda w: w.s["zero_std"] / w.s["groups"]),
    Metric("train/draws", ("draws",), lambda w: w.s["draws"] / w.steps),
    Metric("train/filled_frac", ("filled",), lambda w: w.s["filled"] / w.steps),
    Metric("perf/gen_tokens_per_s", ("tokens", "gen_s"), lambda w: w.s["tokens"] / (w.s["gen_s"] / w.world)),
    Metric("perf/completions_per_s", (), lambda w: w.completions / w.elapsed),
    Metric("perf/train_tokens_per_s", ("train_s",), lambda w: w.s["loss_tokens"] / (w.s["train_s"] / w.world)),
    # where a step's time goes (seconds per step, mean over ranks): the rollout share is gen + score
    *(Metric(f"perf/{phase}_s_per_step", (f"{phase}_s",), lambda w, phase=phase: w.per_step(phase))
      for phase in ("gen", "score", "ref", "train")),
    Metric("perf/compile_s", ("compile_s",), lambda w: w.s["compile_s"] / w.world),  # --compile: apart from gen_s
    Metric("perf/rollout_share", ("gen_s", "score_s"),
           lambda w: (w.s["gen_s"] + w.s["score_s"]) / w.world / w.elapsed),
    # decoding as nanochat's infer_bench reports it, per rank: rows x decode steps, and the bytes those steps must
    # read over the device's peak bandwidth (MBU; where the device's peak is known)
    Metric("perf/decode_tok_s", ("decoded", "decode_s"), lambda w: w.s["decoded"] / max(w.s["decode_s"], 1e-9)),
    # the rows the engine decoded, summed over its steps and the ranks, per GRPO step: rows x decode steps but for
    # the rows eager decoding dropped once they stopped
    Metric("perf/decode_row_steps", ("row_steps",), lambda w: w.s["row_steps"] / w.steps),
    # --advantage distill: the mean reverse KL to the teacher of the tokens sampled
    Metric("train/teacher_kl", ("teacher_kl", "teacher_tokens"), lambda w: w.s["teacher_kl"] / w.s["teacher_tokens"],
           lambda w: bool(w.s["teacher_tokens"])),
    # the trainer's first-update log-probs against the engine's: 1 and 0 but for rounding
    Metric("train/engine_ratio", ("engine_ratio", "engine_tokens"), _per_engine_token("engine_ratio"),
           _engine_compared),
    Metric("train/engine_logp_diff", ("engine_logp_diff", "engine_tokens"), _per_engine_token("engine_logp_diff"),
           _engine_compared),
    Metric("train/engine_far", ("engine_far", "engine_tokens"), _per_engine_token("engine_far"), _engine_compared),
    Metric("perf/decode_mbu", ("decode_bytes", "decode_s"),
           lambda w: w.s["decode_bytes"] / max(w.s["decode_s"], 1e-9) / w.peak_bw, lambda w: bool(w.peak_bw)),
    # --async_rollouts: steps between the weights a rollout came from and those it trains (both counted on every rank)
    Metric("train/staleness", ("staleness",), lambda w: w.s["staleness"] / w.s["steps"], lambda w: w.async_rollouts),
)
# The window's sums: those the metrics read (and each reward's own, reward_<name>)
WINDOW = tuple(dict.fromkeys([*COUNTS, *(name for m in METRICS for name in m.sums)]))


def window_metrics(w: Window) -> dict[str, float]:
    """The logged metrics of one window."""
    out = {}
    for metric in METRICS:
        if metric.per_reward:
            out.update({metric.name.format(reward): metric.formula(w, reward) for reward in w.rewards})
        elif metric.when(w):
            out[metric.name] = metric.formula(w)
    return out
