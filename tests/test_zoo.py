"""The architectures users bring, each built at test time with transformers' own config class (tiny, random, nothing
downloaded): our logits are transformers' forward on a ragged batch, an RM step and a GRPO step run, and the saved
policy loads back in transformers as the same class with the logits it trained to. A family joins by one line in ZOO.
"""
from __future__ import annotations

import contextlib
import json

import pytest
import torch
import transformers

from nanochat_ext.algorithms.grpo import LossConfig, policy_backward
from nanochat_ext.algorithms.rm import rm_backward
from nanochat_ext.algorithms.rollout_batch import RolloutBatch
from nanochat_ext.data.batching import TokenizedPair, collate_pairs
from nanochat_ext.engine.engine import Engine
from nanochat_ext.engine.sampling import SamplingConfig
from nanochat_ext.errors import InputError
from nanochat_ext.models.backbone import Backbone
from nanochat_ext.models.heads import HeadTransform, probe
from nanochat_ext.models.loader import load_backbone, load_tokenizer_for
from nanochat_ext.models.reward_model import RewardModel
from nanochat_ext.training.logprobs import CompletionLogprobs, make_sequences

LLAMA_LIKE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
# family: (config class, its arguments beyond LLAMA_LIKE's, or all of them where the names differ). Caps and scales
# are set far from 1 so that logits without them would differ plainly.
ZOO = {
    "llama3": ("LlamaConfig", dict(rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                                          low_freq_factor=1.0, high_freq_factor=4.0,
                                                          original_max_position_embeddings=32))),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=8)),
    "gemma": ("GemmaConfig", dict(head_dim=8)),
    "gemma2": ("Gemma2Config", dict(head_dim=8, final_logit_softcapping=1.0, sliding_window=4)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=8, final_logit_softcapping=1.0, sliding_window=4)),
    "phi3": ("Phi3Config", dict(pad_token_id=1)),
    "mistral": ("MistralConfig", {}),
    "olmo2": ("Olmo2Config", {}),
    "smollm3": ("SmolLM3Config", {}),
    "cohere": ("CohereConfig", dict(logit_scale=0.25)),
    "cohere2": ("Cohere2Config", dict(logit_scale=0.25, sliding_window=4)),
    "granite": ("GraniteConfig", dict(logits_scaling=4.0)),
    "granitemoe": ("GraniteMoeConfig", dict(logits_scaling=4.0, num_local_experts=2, num_experts_per_tok=1)),
    "vaultgemma": ("VaultGemmaConfig", dict(head_dim=8, final_logit_softcapping=1.0, sliding_window=4)),
    "nanochat": ("NanoChatConfig", dict(intermediate_size=128)),  # on our GPT: the "transformers" vintage
    "nanochat_cap2": ("NanoChatConfig", dict(intermediate_size=128, final_logit_softcapping=2.0)),  # transformers'
    "stablelm": ("StableLmConfig", {}),
    "starcoder2": ("Starcoder2Config", {}),
    "gpt_neox": ("GPTNeoXConfig", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, max_position_embeddings=128)),
    "gpt2": ("GPT2Config", dict(n_embd=32, n_layer=2, n_head=4, n_positions=128)),
}

NATIVE = {"mistral", "qwen2", "nanochat"}  # on our own modules (llama.py, gpt.py); the rest on transformers'


def make_family(family: str, tokenizer_dir, out) -> transformers.PreTrainedModel:
    """A tiny random model of the family, saved with the tiny tokenizer beside it; returns transformers' own."""
    name, extra = ZOO[family]
    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config_class = getattr(transformers, name)
    base = {} if family in ("gpt_neox", "gpt2") else LLAMA_LIKE
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = config_class(**{**base, "vocab_size": len(tok), **ids, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # weights large enough that caps and scales change the logits plainly
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return model.eval()


def ragged(pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    lengths = [9, 5, 7]
    ids = torch.full((len(lengths), max(lengths)), pad_id, dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.randint(5, 500, (n,), generator=g)
    return ids, torch.arange(ids.size(1))[None] < torch.tensor(lengths)[:, None]


@pytest.mark.parametrize("family", sorted(ZOO))
def test_the_zoo_trains_on_its_own_logits_and_saves_back(family, assets, tmp_path):
    theirs = make_family(family, assets["hf"], tmp_path / "model")
    bb = load_backbone(tmp_path / "model")
    assert bb.native == (family in NATIVE)
    tok = load_tokenizer_for(bb, tmp_path / "model")

    ids, real = ragged(tok.pad_id)  # right-padded rows of 9, 5 and 7 tokens
    with torch.no_grad():
        want = theirs(input_ids=ids, attention_mask=real.long()).logits
        ours = bb(ids)
    assert torch.allclose(ours[real], want[real], rtol=1e-4, atol=1e-4 * float(want.abs().max())), \
        (family, float((ours - want)[real].abs().max()))

    rm = RewardModel(bb)  # one Bradley-Terry step through the backbone
    rm.init_head(0)
    pairs = [TokenizedPair([5, 6, 7, 8], [5, 6, 9], 1.0), TokenizedPair([10, 11, 12], [10, 13, 14, 15, 16], 1.0)]
    bb.requires_grad_(True)
    for p in bb.output_head_params():  # as kat_train_rm: a head the RM never calls gets no gradient
        p.requires_grad_(False)
    stats = rm_backward(rm, [collate_pairs(pairs, tok.pad_id)], "none", None, torch.device("cpu"),
                        contextlib.nullcontext())
    assert torch.isfinite(stats).all() and any(p.grad is not None and p.grad.abs().sum() > 0 for p in bb.parameters())
    bb.zero_grad(set_to_none=True)

    bb.requires_grad_(True)  # one GRPO step: rollouts by our engine, then the policy's loss
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=4)
    samples = Engine(bb).generate(prompts, 2, cfg, tok.stop_ids, tok.pad_id,
                                  [torch.Generator().manual_seed(i) for i in range(2)])
    completions = [c if c else [tok.eos_id] for c in samples.completions]
    batch = RolloutBatch.of(make_sequences(prompts, completions, 2, tok.pad_id),
                            advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]), weights=torch.ones(4))
    before = {k: v.detach().clone() for k, v in bb.state_dict().items()}
    optimizer = torch.optim.SGD([p for p in bb.parameters() if p.requires_grad], lr=0.1)
    stats = policy_backward(CompletionLogprobs(bb), batch, 4, LossConfig(), torch.device("cpu"),
                            contextlib.nullcontext())
    optimizer.step()
    assert torch.isfinite(stats).all()
    assert any(not torch.equal(before[k], v) for k, v in bb.state_dict().items())

    out = bb.save(tmp_path / "out", 1, {"kind": "policy"}, tok)  # loads back in transformers as the same class
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    assert type(again) is type(theirs)
    assert json.loads((out / "config.json").read_text())["model_type"] == theirs.config.model_type
    with torch.no_grad():
        assert torch.allclose(again(input_ids=ids, attention_mask=real.long()).logits[real], bb.eval()(ids)[real],
                              rtol=1e-4, atol=1e-4 * float(want.abs().max()))


class HeadAfterScaledStates(transformers.LlamaForCausalLM):
    """A forward that scales the final hidden states before its head (as MiniCPM-style models do)."""
    def forward(self, input_ids=None, **kwargs):
        hidden = self.model(input_ids=input_ids).last_hidden_state
        return transformers.modeling_outputs.CausalLMOutputWithPast(logits=self.lm_head(hidden * 0.5))


class NormalisedLogits(HeadAfterScaledStates):
    """A forward that returns log-probabilities: not elementwise, so not reproducible per chunk of logits."""
    def forward(self, input_ids=None, **kwargs):
        hidden = self.model(input_ids=input_ids).last_hidden_state
        return transformers.modeling_outputs.CausalLMOutputWithPast(logits=self.lm_head(hidden).log_softmax(-1))


def test_a_head_transform_is_read_from_the_forward_or_refused():
    config = transformers.LlamaConfig(**LLAMA_LIKE, vocab_size=50)
    assert probe(transformers.LlamaForCausalLM(config), "llama").identity
    assert probe(HeadAfterScaledStates(config), "scaled") == HeadTransform(scale=0.5)
    refused = ("NormalisedLogits's forward transforms its LM head's output in a way this trainer cannot reproduce "
               "per chunk")
    with pytest.raises(InputError, match=refused):
        probe(NormalisedLogits(config), "normalised")
    bb = Backbone("hf", NormalisedLogits(config), "normalised")  # a reward model reads its hidden states alone
    assert RewardModel(bb)(torch.tensor([[1, 2, 3]]), torch.tensor([3])).shape == (1,)
    with pytest.raises(InputError, match=refused):  # log-probs are refused before any training
        CompletionLogprobs(bb)
