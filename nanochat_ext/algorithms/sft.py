"""Supervised fine-tuning's step: next-token loss on the turns to learn of each conversation (what a tool wrote
left out), averaged over the learnt tokens of the global batch (logprobs.sft_backward).
"""
from __future__ import annotations

from nanochat_ext.agent.agent import Agent
from nanochat_ext.config import NO, TrainerSpec
from nanochat_ext.data.batching import GlobalBatchLoader, cut_to_fit
from nanochat_ext.data.conversations import Conversation
from nanochat_ext.errors import InputError
from nanochat_ext.tokenizer import TokenizerWrapper
from nanochat_ext.training.logprobs import make_sequences, sft_backward
from nanochat_ext.training.loop import Loop
from nanochat_ext.training.memory import StepMemory
from nanochat_ext.training.optim import ADAMW_ONLY
from nanochat_ext.training.setup import PolicyTraining
from nanochat_ext.training.tracking import WindowSums

Example = tuple[list[int], list[int], list[int]]  # prompt ids, reply ids, reply mask (0: a token not to learn)

SPEC = TrainerSpec(
    name="sft", kind="sft", script="kat_sft", wrote="an SFT model", model_flag=("--backbone", "the model to fine-tune"),
    # TRL 1.16's SFTTrainer lr
    defaults={"batch_size": 32, "max_steps": 300, "num_epochs": NO, "optimizer": NO, "lr": 2e-5, "warmup_steps": 10,
              "lr_decay": NO, "log_every": 20, "eval_every": NO, "density": NO, "val_ratio": NO, "max_len": None},
    words={"unit": "conversations", "micro_unit": "conversations", "model": "model", "steps": "optimizer steps",
           "max_steps": "%(default)s", "epochs": "", "seeds": "", "responses": "replies", "at_most": "",
           "val_ratio": "", "stage_dir": "chatsft_checkpoints", "tag": "'default'", "lr": "2e-5, TRL's", **ADAMW_ONLY},
    lr_cliff=(2e-3, "held-out tool calls fell to none and accuracy with the tool to 0.000 in 8 steps (the replies echo "
                    "a factor), where 2e-4 reached 0.969"))


def sft_examples(conversations: list[Conversation], tok: TokenizerWrapper, max_len: int, agent: Agent,
                 path: str) -> list[Example]:
    """Each conversation rendered and cut as the RM's pairs are: the prompt from the left, the reply from the right.
    A chat model's conversation is rendered by its chat template, tool calls and tool turns included, its assistant
    turns learnt through the template's end-of-turn token; nanochat's (or a tokenizer's without a template), the
    prompt and then the reply to learn (nanochat's python parts with their outputs masked)."""
    examples = []
    for c in conversations:
        if tok.chat_template:
            if any(isinstance(m["content"], list) for m in c.turns):
                raise InputError("a reply in nanochat's parts needs nanochat's tokenizer (a chat model's tool calls "
                                 "are tool_calls)", path, c.line, "messages")
            messages = agent.for_template(c.prompt + c.turns)
            p, r, mask = tok.render_conversation(messages, len(messages) - len(c.turns), agent.template_tools)
        else:
            if len(c.turns) > 1 or c.turns[0].get("tool_calls"):
                raise InputError(f"tool calls and tool turns need a chat template to render them ({tok.source} has "
                                 f"none; nanochat's tool calls are python parts)", path, c.line, "messages")
            r, mask = tok.render_reply(c.turns[0]["content"])
            p = agent.render_prompt(c.prompt)  # your tools listed as the rollouts list them
        p, r = cut_to_fit(p, r, max_len, tok.bos_id)
        examples.append((p, r, mask[:len(r)]))
    return examples


class SFT:
    """The SFT method of the loop (training/loop.py)."""
    name = SPEC.name
    headline = ("train/loss", "perf/tokens_per_s")  # its step line (--log_line short)
    evaluation = None  # SFT holds nothing out

    def __init__(self, training: PolicyTraining, examples: list[Example], loader: GlobalBatchLoader,
                 estimate: StepMemory):
        self.training, self.examples, self.loader, self.estimate = training, examples, loader, estimate
        self.plan = loader.plan
        self.window = WindowSums(["loss", "tokens", "steps"])  # this rank's sums since the last log

    def step(self, step: int, loop: Loop) -> None:
        t, plan, pad_id = self.training, self.plan, self.training.tok.pad_id
        mine = [self.examples[i] for mb in self.loader.micro_batches(step) for i in mb]
        batch = make_sequences([e[0] for e in mine], [e[1] for e in mine], 1, pad_id, token_mask=[e[2] for e in mine])
        with loop.progress.doing(f"a training micro-batch of {plan.device_batch_size} conversations",
                                 t.training_hints(plan.device_batch_size, plan.per_rank)):
            stats = sft_backward(t.ddp_model, batch, plan.device_batch_size, t.env.device, t.autocast)
        loop.update(stats[0].item())
        self.window.add(loss=stats[0].item(), tokens=stats[1].item())

    def metrics(self, s: dict[str, float], elapsed: float) -> dict[str, float]:
        """Every rank's loss is its share of the global one; steps count once per rank."""
        return {"train/loss": s["loss"] / (s["steps"] / self.training.env.world_size),
                "perf/tokens_per_s": s["tokens"] / elapsed}

    def resume_state(self) -> dict:
        return {"device_batch_size": self.plan.device_batch_size}
