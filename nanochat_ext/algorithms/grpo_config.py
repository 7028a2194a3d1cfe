"""GRPO's configuration: the advantage estimator and its scaling, the loss's aggregation, clipping and KL, the
importance ratio and the engine's correction (TRL's GRPOConfig names where TRL has the option); combinations the
estimator does not define are refused from what it declares (advantages.ESTIMATORS)."""
from __future__ import annotations

from dataclasses import dataclass

from nanochat_ext.algorithms.advantages import ESTIMATORS, KL_ESTIMATORS, SCALE_REWARDS, STD_MODES
from nanochat_ext.config import FINITE_NON_NEGATIVE, FINITE_POSITIVE, POSITIVE, option
from nanochat_ext.errors import InputError

LOSS_AGGS = ("token", "sequence", "dr_grpo")
# TRL's --loss_type names for the same aggregations. bnpo divides each micro-batch by its own token count
# in TRL; here by the global batch's (as TRL's dapo): the same when a step is one micro-batch on one rank.
TRL_LOSS_TYPES = {"dapo": "token", "bnpo": "token", "grpo": "sequence", "dr_grpo": "dr_grpo"}
IMPORTANCE_LEVELS = ("token", "sequence", "sequence_product")
# --engine_correction: TRL's vllm_importance_sampling_mode, for the gap between the rollout engine's log-probs and the
# trainer's (Yao et al. 2025: TIS truncates the ratio, MIS masks past it; per token or per completion)
ENGINE_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
@dataclass(frozen=True)
class GRPOConfig:
    """GRPO's advantages and loss (TRL's GRPOConfig names where TRL has the option)."""
    advantage: str = option("grpo", "grpo: r minus its group's mean; rloo: r minus the mean of its group's other "
                                    "samples (leave-one-out, Ahmadian et al. 2024, TRL's RLOOTrainer; TRL's RLOO "
                                    "scales as --scale_rewards none, its default here, or batch with "
                                    "normalize_advantages; --beta "
                                    "the KL penalty in the reward, each completion's summed); "
                                    "reinforce_pp(_baseline): REINFORCE++'s per-token returns, --beta the KL "
                                    "penalty in the reward, whitened over the batch (OpenRLHF's reinforce and "
                                    "reinforce_baseline; --scale_rewards unused); distill: on-policy distillation, "
                                    "each token's advantage minus --teacher_coef x its reverse KL to --teacher (the "
                                    "Tinker cookbook's recipe; any reward, centred in its group, adds to it)",
                            choices=ESTIMATORS)  # read at each parse: a registered estimator is a choice
    teacher_coef: float = option(1.0, "--advantage distill: the coefficient of the reverse KL to the teacher (the "
                                      "cookbook's kl_penalty_coef)", check=FINITE_POSITIVE)
    teacher_discount: float = option(0.0, "--advantage distill: a token's advantage sums the reverse KL of the tokens "
                                          "after it, discounted by this (0: its own alone; the cookbook's "
                                          "kl_discount_factor)", check=(lambda v: 0 <= v <= 1, "in [0, 1]"))
    kl_estimator: str = option("k1", "--advantage rloo and reinforce_pp*: the per-token KL in the reward, from "
                                     "pi_old's and the reference's log-probs: k1 = their difference (TRL's RLOO), k2 = "
                                     "its square / 2, k3 (OpenRLHF's --kl_estimator)", choices=KL_ESTIMATORS)
    scale_rewards: str | None = option(None, "advantage = (r - baseline) / std of the group, of the batch, or "
                                             "unscaled; default: the estimator's reference's, group for grpo (TRL's "
                                             "GRPOTrainer), none for rloo (TRL's RLOOTrainer, normalize_advantages="
                                             "False); reinforce_pp* and distill scale their own way",
                                       choices=SCALE_REWARDS)
    std_mode: str = option("sample", "std for --scale_rewards: sample (divide by n - 1, as TRL and torch.std do, so a "
                                     "TRL config means the same lr and beta here) or population (divide by n: at G=2 "
                                     "advantages 1.41x larger)", choices=STD_MODES)
    loss_agg: str = option("token", "with l_it the loss of token t of completion i (mask m_it) over the global batch: "
                                    "token: sum_it l_it / sum_it m_it (DAPO); sequence: mean_i (sum_t l_it / sum_t "
                                    "m_it) (GRPO paper); dr_grpo: sum_it l_it / (completions x max_new_tokens)",
                           choices=LOSS_AGGS)
    loss_type: str | None = option(None, "TRL's name for --loss_agg: dapo = token, grpo = sequence, dr_grpo = dr_grpo, "
                                         "bnpo = token (TRL's bnpo normalises each micro-batch by its own tokens; here "
                                         "the global batch's)", choices=list(TRL_LOSS_TYPES))
    importance_level: str = option("token", "token: ratio r_it = pi(y_it) / pi_old(y_it) per token (GRPO); "
                                            "sequence: GSPO's s_i = exp(mean_t log r_it) for every token of completion "
                                            "i, clipped per completion. The GSPO paper pairs it with --loss_agg "
                                            "sequence; token sums weight a completion by its length. "
                                            "sequence_product: exp(sum_t log r_it), the completion's own probability "
                                            "ratio (TRL's RLOOTrainer, with --loss_agg sequence)",
                                   choices=IMPORTANCE_LEVELS)
    clip_eps: float = option(0.2, "PPO clip range", type=float, check=FINITE_NON_NEGATIVE)
    clip_eps_high: float | None = option(None, "upper clip range (DAPO's clip-higher); default: clip_eps", type=float,
                                         check=FINITE_NON_NEGATIVE)
    beta: float = option(0.04, "weight of the k3 KL to the frozen reference in the loss (with --advantage rloo and "
                               "reinforce_pp*: of --kl_estimator's KL in the reward); 0 skips the reference model",
                         type=float, check=FINITE_NON_NEGATIVE)
    num_iterations: int = option(1, "optimizer updates per rollout batch, mu", type=int, check=POSITIVE)
    engine_correction: str = option("none", "weight each token's loss by w = pi_old / pi_engine, the trainer's "
                                            "log-prob against the one the engine sampled with (train/engine_ratio): "
                                            "per token or per completion (the product of its tokens' ratios), "
                                            "truncated to [--engine_clip_min, --engine_clip_max] or 0 outside it "
                                            "(mask); TRL's vllm_importance_sampling_mode",
                                    choices=ENGINE_CORRECTIONS)
    engine_clip_max: float | None = option(3.0, "upper bound of --engine_correction's ratio", type=float,
                                           check=POSITIVE)
    engine_clip_min: float | None = option(None, "lower bound of --engine_correction's ratio (default: none)",
                                           type=float, check=FINITE_NON_NEGATIVE)

    @property
    def uses_reference(self) -> bool:
        """Whether a frozen reference is read: the loss's KL or RLOO's and REINFORCE++'s in the reward (distillation
        reads the teacher)."""
        return self.beta > 0 and self.advantage != "distill"

    @property
    def kl_in_reward(self) -> bool:
        """Whether --beta weighs a KL in the reward (RLOO's, REINFORCE++'s) rather than in the loss."""
        return ESTIMATORS[self.advantage].kl_in_reward

    @property
    def scaling(self) -> str:
        """--scale_rewards, or where not given the estimator's reference's default."""
        return self.scale_rewards or ESTIMATORS[self.advantage].default_scale or "none"

    def check(self, filter_zero_std: bool) -> None:
        """One line for a combination the estimator does not define (from what it declares: advantages.ESTIMATORS)."""
        est, named = ESTIMATORS[self.advantage], f"--advantage {self.advantage}"
        if self.scale_rewards and self.scale_rewards not in est.scalings:
            raise InputError(f"--scale_rewards {self.scale_rewards}: {named} does not read it ({est.reference}); "
                             f"leave it off")
        if self.scaling == "group" and est.kl_in_reward and self.beta > 0:
            raise InputError(f"{named} --beta {self.beta:g} puts a KL in the reward, and --scale_rewards group divides "
                             f"each group by its own spread: a group whose task rewards are all equal differs only by "
                             f"beta x KL (~1e-3) and would train as hard as one that succeeded and failed. Use "
                             f"--scale_rewards none ({est.reference}) or batch (its normalize_advantages), or --beta 0")
        if filter_zero_std and not est.zero_when_rewards_equal(self.beta):
            why = "the KL in its reward tells the group's members apart" if est.centred_in_group else est.reference
            raise InputError(f"--filter_zero_std drops the groups whose rewards are all equal as carrying no signal, "
                             f"but {named}{f' --beta {self.beta:g}' if est.kl_in_reward else ''} gives such a group "
                             f"non-zero advantages ({why}): leave it off" + (", or --beta 0" if est.centred_in_group
                                                                            else ""))

    def loss(self, max_new_tokens: int) -> LossConfig:
        """The loss's settings; RLOO's and REINFORCE++'s KL is in the reward, not the loss,
        and distillation has none."""
        beta = 0.0 if self.kl_in_reward or self.advantage == "distill" else self.beta
        return LossConfig(self.loss_agg, self.clip_eps, self.clip_eps_high, beta, max_new_tokens,
                          self.importance_level, self.engine_correction, self.engine_clip_max, self.engine_clip_min)


@dataclass
class LossConfig:
    loss_agg: str = "token"
    clip_eps: float = 0.2
    clip_eps_high: float | None = None  # None: same as clip_eps
    beta: float = 0.0
    max_new_tokens: int = 64  # dr_grpo's constant normaliser
    importance_level: str = "token"  # sequence: GSPO's one ratio per completion
    engine_correction: str = "none"  # ENGINE_CORRECTIONS
    engine_clip_max: float | None = 3.0
    engine_clip_min: float | None = None
