"""Docs that cannot rot: every script command in README.md and docs/ uses only flags its script has, every variable
speedrun.sh and pipelines/*.sh read is in the pipeline page's table of knobs, and the README's hand-run stages run as it
says."""
from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO, run_script
from forked import run_python

from nanochat_ext.data.batching import read_pairs
from nanochat_ext.tasks.synthetic import make_tiny_hf_llama
from scripts.kat_docs import SCRIPTS

DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
STAGE_ARGS = {"SFT_ARGS": "kat_sft", "RM_ARGS": "kat_train_rm", "GRPO_ARGS": "kat_train_grpo",
              "DPO_ARGS": "kat_train_dpo", "EVAL_ARGS": "kat_eval", "DEMO_ARGS": "kat_demo_data"}


def accepted(script: str) -> set[str]:
    """The flags a script takes, each in its underscore and its dashed spelling."""
    flags = {s for a in importlib.import_module(f"scripts.{script}").flags()._actions for s in a.option_strings}
    return flags | {f.replace("_", "-") for f in flags}


def commands(text: str) -> list[tuple[str, list[str]]]:
    """(script, the flags it is given) for each `-m scripts.X ...` command (joined across backslash-ended lines) and
    each `<STAGE>_ARGS="..."` of speedrun.sh."""
    text = re.sub(r"\\\n\s*", " ", text)
    found = []
    for line in text.splitlines():
        for m in re.finditer(r"-m scripts\.(\w+)((?:\s+(?:--?[\w-]+|\"[^\"]*\"|'[^']*'|[^\s`|;&#]+))*)", line):
            found.append((m.group(1), re.findall(r"(?<![\w\"'=-])(--[a-z][\w-]*)", m.group(2))))
        for m in re.finditer(r"\b(\w+_ARGS)=\"([^\"]*)\"", line):
            if m.group(1) in STAGE_ARGS:
                found.append((STAGE_ARGS[m.group(1)], re.findall(r"(--[a-z][\w-]*)", m.group(2))))
    return found


def test_every_command_in_the_docs_uses_flags_its_script_has():
    unknown, seen = [], 0
    for doc in DOCS:
        for script, flags in commands(doc.read_text()):
            if not (REPO / "scripts" / f"{script}.py").is_file():
                unknown.append(f"{doc.name}: no script {script}")
                continue
            seen += 1
            unknown += [f"{doc.relative_to(REPO)}: {script} has no {flag}" for flag in flags
                        if flag not in accepted(script)]
    assert seen > 20 and not unknown, unknown


def test_the_check_finds_a_flag_a_script_does_not_have():
    found = commands('```\ntorchrun --standalone --nproc_per_node=8 -m scripts.kat_train_rm -- --backbone b \\\n'
                     '    --pairs p --no_such_flag 3\n```\nGRPO_ARGS="--lr 1e-3 --beta 0"')
    assert found == [("kat_train_rm", ["--backbone", "--pairs", "--no_such_flag"]),
                     ("kat_train_grpo", ["--lr", "--beta"])]
    assert "--no_such_flag" not in accepted("kat_train_rm") and "--max-steps" in accepted("kat_train_rm")


def test_every_variable_speedrun_reads_is_in_the_pipeline_page():
    scripts = [REPO / "speedrun.sh", REPO / "scripts" / "setup_env.sh", *sorted((REPO / "pipelines").glob("*.sh"))]
    reads = {m for f in scripts for m in re.findall(r"\$\{([A-Z_][A-Z0-9_]*):?-", f.read_text())}
    page = (REPO / "docs" / "pipeline.md").read_text()
    table = page[page.index("## Knobs"):].split("\n## ")[0]
    listed = {name for row in table.splitlines() if row.startswith("| `")
              for name in re.findall(r"`([A-Z_][A-Z0-9_]*)`", row.split(" | ")[0])}
    assert {"NPROC_PER_NODE", "GRPO_ARGS", "SAVE_EVERY"} <= reads
    assert reads - listed == set(), f"the pipeline reads these, docs/pipeline.md's table lacks them: {reads - listed}"


def test_every_link_between_the_docs_resolves():
    """A relative link in README.md or docs/ names a file that is there."""
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(REPO)} -> {target}")
    assert not broken, broken


def readme_by_hand() -> tuple[dict[str, str], dict[str, list[str]]]:
    """The README's by-hand block: its settings line (B=... MODEL=... as written) and each stage's flags after
    torchrun's `--`, by module, its lines joined."""
    section = readme_section("Your model on 8 GPUs")
    block = re.sub(r"\\\n\s*", " ", section.split("```bash\n")[2].split("```")[0])
    settings = next(line for line in block.splitlines() if line.startswith("B="))
    stages = {m.group(1): shlex.split(m.group(2)) for m in re.finditer(r"-m scripts\.(\w+) -- (.*)", block)}
    return dict(w.split("=", 1) for w in shlex.split(settings.split("#")[0])), stages


def as_set(args: list[str], values: dict[str, str], **sizes: str) -> list[str]:
    """A stage's flags with the block's variables set to `values` and the flags in `sizes` (--batch_size ...) given
    smaller values."""
    args = [re.sub(r"\$(\w+)", lambda m: values[m.group(1)], a) for a in args]
    for flag, value in sizes.items():
        args[args.index(f"--{flag}") + 1] = value
    return args


def test_the_readmes_by_hand_block_runs_after_the_demo_and_leaves_its_outputs_alone(assets, tmp_path):
    """#89: the README's stages by hand, run after the demo as its prose says (MODEL `sft:default`, DATA `$B/demo`,
    its TAG): at 60 RM steps of 8 pairs, 2 GRPO and DPO steps of 2, and one process, where it says 500 of 256 and 8.
    Every output lands beside the demo's (the demo's density weights, its RM trained with --unfreeze_last 1, its
    report: untouched, where stage 1 once replaced the weights and stage 2 refused to resume the demo's RM). The RM
    stage as written (its density weights, --unfreeze_last 2, no --save_every), SIGKILLed in step 40
    (tests/workers/die_at.py: no cleanup), has its step-25 checkpoint (the default --save_every, a tenth of the run
    but at least 25 steps); the same command resumes there and finishes; run again, it trains nothing."""
    base, env = tmp_path / "base", {"NANOCHAT_BASE_DIR": str(tmp_path / "base")}
    shutil.copytree(assets["gpt"], base / "chatsft_checkpoints" / "default")  # what the demo leaves, in its places
    shutil.copytree(assets["tokenizer"], base / "tokenizer")
    (base / "demo").mkdir()
    for name in ("pairs", "prompts", "eval_pairs", "eval_prompts"):
        shutil.copy(assets["pairs"], base / "demo" / f"{name}.jsonl")
    prompts = sorted({row.prefix_id for row in read_pairs(str(assets["pairs"]), None, 0.0)[0]})
    (base / "density").mkdir()
    (base / "density" / "weights.jsonl").write_text("".join(json.dumps({"prefix_id": p, "weight": 1.0 + i % 3}) + "\n"
                                                            for i, p in enumerate(prompts)))
    demo_rm = run_script("scripts.kat_train_rm", ["--backbone", "sft:default",
                                                  "--pairs", str(base / "demo" / "pairs.jsonl"),
                                                  "--density", str(base / "density" / "weights.jsonl"),
                                                  "--unfreeze_last", "1", "--batch_size", "8", "--max_steps", "2"],
                         env=env)
    assert demo_rm.returncode == 0 and (base / "rm_checkpoints" / "density").is_dir(), demo_rm.stderr[-2000:]
    (base / "report.md").write_text("the demo's report\n")
    demo = {p: p.read_bytes() for p in base.rglob("*") if p.is_file()}

    prose = readme_section("Your model on 8 GPUs")
    model, data = re.search(r"after the demo, its model is `([^`]+)` and its data `([^`]+)`",
                            " ".join(prose.split())).groups()
    settings, stages = readme_by_hand()
    assert settings["B"] == "$NANOCHAT_BASE_DIR" and settings["MODEL"] == "sft:d20" and model == "sft:default"
    values = {**settings, "B": str(base), "MODEL": model, "DATA": data.replace("$B", str(base))}
    assert list(stages) == ["kat_compute_density", "kat_train_rm", "kat_train_grpo", "kat_train_dpo", "kat_eval"]
    for stage in ("kat_train_rm", "kat_train_grpo", "kat_train_dpo"):  # every hand-run training stage resumes
        assert stages[stage][stages[stage].index("--resume") + 1] == "latest", stage
    ran = run_script("scripts.kat_compute_density", as_set(stages["kat_compute_density"], values), env=env)
    assert ran.returncode == 0, ran.stderr[-2000:]

    args = as_set(stages["kat_train_rm"], values, batch_size="8", max_steps="60")
    assert "--save_every" not in args and args[args.index("--backbone") + 1] == "sft:default"
    # a fresh interpreter, not a fork of the warm one: die_at patches the step before the trainer's modules import it
    killed = subprocess.run([sys.executable, str(REPO / "tests" / "workers" / "die_at.py"), "kat_train_rm",
                             "0:step:40", *args],
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **env},
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert "save_every: 25 steps, and the end" in killed.stdout
    resumed = run_script("scripts.kat_train_rm", args, env=env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert re.search(r"resume: from \S+ at step 25\n", resumed.stdout), resumed.stdout
    final = resumed.stdout.strip().splitlines()[-1]
    model_file = base / "rm_checkpoints" / values["TAG"] / final.rsplit("/", 1)[-1]
    assert final == f"checkpoint: {model_file}"
    assert json.loads(model_file.with_name(model_file.name.replace("model_", "meta_")[:-3]
                                           + ".json").read_text())["step"] == 60
    again = run_script("scripts.kat_train_rm", args, env=env)
    assert again.returncode == 0 and "nothing to train" in again.stdout, again.stdout
    assert again.stdout.strip().splitlines()[-1] == final

    small = {"batch_size": "2", "max_new_tokens": "8"}
    for stage, sizes in [("kat_train_grpo", {**small, "group_size": "2", "max_steps": "2"}),
                         ("kat_train_dpo", {"batch_size": "2"}), ("kat_eval", {"max_new_tokens": "8"})]:
        extra = ["--max_steps", "2"] if stage == "kat_train_dpo" else []  # its --num_epochs 1, cut short
        ran = run_script(f"scripts.{stage}", as_set(stages[stage], values, **sizes) + extra, env=env)
        assert ran.returncode == 0, (stage, ran.stderr[-2000:])
    report = json.loads((base / "reports" / values["TAG"] / "report.json").read_text())
    assert set(report["policies"]) >= {"GRPO", "DPO"} and list(report["reward_models"]) == [
        str(base / "rm_checkpoints" / values["TAG"])]
    assert {p: p.read_bytes() for p in demo} == demo  # the demo's outputs, every byte as it left them


def readme_section(title: str) -> str:
    return (REPO / "README.md").read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_readmes_hugging_face_section_runs_with_a_tiny_model_standing_in(tmp_path):
    """The README's "Your Hugging Face model" as a user follows it (the repo on the path, as its root with .venv
    active puts it), in an empty directory: its my_task.py as shown, a
    tiny Llama with a Qwen-style tool template where its `hf download` puts Qwen2.5 (no network here), its GRPO command
    (the reward and the tool from my_task.py) and its DPO command as written, on one process where they say 8 and at
    2 steps of 2 prompts x 2 samples where they say 500 of 64 x 8; then its last command loads the GRPO model back in
    transformers; then its Python block (nanochat_ext.api) runs GRPO again, at the same sizes."""
    section = readme_section("Your Hugging Face model")
    my_task = re.search(r"```python\n# my_task.py\n(.*?)```", section, re.S).group(1)
    (tmp_path / "my_task.py").write_text(my_task)
    bash = re.sub(r"\\\n\s*", " ", re.search(r"```bash\n(.*?)```", section, re.S).group(1))
    download, grpo, dpo, load = [line for line in bash.splitlines() if line and not line.startswith("#")]
    words = shlex.split(download)
    assert words[:2] == ["hf", "download"] and (Path(sys.executable).parent / "hf").is_file()  # .venv's CLI
    make_tiny_hf_llama(tmp_path / words[words.index("--local-dir") + 1], template="chatml_tools", max_positions=1024)
    questions = [(a, b) for a in range(2, 7) for b in range(3, 5)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"What is {a} times {b}?", "answer": a * b})
                                                    + "\n" for a, b in questions))
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"prompt": f"What is {a} times {b}?", "chosen": str(a * b),
                                                              "rejected": str(a + b)}) + "\n" for a, b in questions))
    small = {"--batch_size": "2", "--group_size": "2", "--max_new_tokens": "24", "--max_steps": "2"}
    for line in (grpo, dpo):
        assert "torchrun --standalone --nproc_per_node=8 -m scripts." in line
        module, args = line.split(" -m ", 1)[1].split(" -- ", 1)
        args = shlex.split(args)
        for flag, value in small.items():
            if flag in args:
                args[args.index(flag) + 1] = value
        proc = run_script(module, args, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(r) for r in (tmp_path / "runs" / "grpo" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/reward_reward" in r and "train/tool_calls" in r] == [1, 2]
    assert len(list((tmp_path / "runs" / "dpo").glob("model_*"))) == 1
    python, flag, code = shlex.split(load)
    assert (python, flag) == ("python", "-c")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    loaded = run_python(["-c", code], 1, env, tmp_path, 120)
    assert loaded.returncode == 0 and loaded.stdout.strip() == "['LlamaForCausalLM']", loaded.stderr[-2000:]
    # the same GRPO run from Python (nanochat_ext.api), as the section writes it, at the same small sizes
    notebook = re.search(r"```python\n(from datasets import .*?)```", section, re.S).group(1)
    for name, value in {"group_size": 2, "max_new_tokens": 24, "batch_size": 2, "max_steps": 2}.items():
        notebook, n = re.subn(rf"\b{name}=\d+", f"{name}={value}", notebook)
        assert n == 1, name
    (tmp_path / "notebook.py").write_text(notebook)
    ran = run_python([str(tmp_path / "notebook.py")], 1, env, tmp_path, 300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    rows = [json.loads(r)
            for r in (tmp_path / "runs" / "grpo_python" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/reward_reward" in r and "train/tool_calls" in r] == [1, 2]
    printed = tmp_path / ran.stdout.strip().splitlines()[-1]  # the checkpoint, where the call was told to write it
    assert printed == sorted((tmp_path / "runs" / "grpo_python").glob("model_*[0-9]"))[-1]


def test_every_figure_in_the_readme_is_in_the_report_it_comes_from():
    """#66 item 5, one source for figures: each decimal figure of the README (outside its code blocks and the Install
    section's versions) appears in bench/RESULTS.md or in a page its own paragraph, bullet or table row links, so a
    figure rounded, mixed up or left behind when a report changes fails here (the README once quoted an H100 ratio as
    1.3-3.9x on CPU, where the two ends were of different units)."""
    readme = re.sub(r"```.*?```", "", (REPO / "README.md").read_text(), flags=re.S)
    readme = re.sub(r"\n## Install\n.*?(?=\n## )", "\n", readme, flags=re.S)
    results = (REPO / "bench" / "RESULTS.md").read_text()
    unsourced = []
    for part in re.split(r"\n\s*\n|\n(?=\| )|\n(?=- )", readme):
        linked = [REPO / link for link in re.findall(r"\]\(([^)#]+\.md)", part)]
        sources = results + "".join(page.read_text() for page in linked)
        unsourced += [(figure, part[:80]) for figure in re.findall(r"(?<![\w.])\d+\.\d+(?!\d)", part)
                      if not re.search(rf"(?<![\d.]){re.escape(figure)}(?!\d)", sources)]  # 1.4 is not in 1.43
    assert not unsourced, unsourced


def test_the_memory_figures_in_the_docs_are_the_memory_models():
    """docs/scaling.md's table is what `bench/memory_estimate.py --table` prints from the memory model today, and
    RESULTS.md's newest LoRA figures quote that table (they once kept an older arithmetic's 32/46 against its 40/57)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    printed = run_python([str(REPO / "bench" / "memory_estimate.py"), "--table"], 1, env, REPO, 120)
    assert printed.returncode == 0, printed.stderr[-2000:]
    table = printed.stdout.strip()
    assert table in (REPO / "docs" / "scaling.md").read_text()
    cells = {row.split(" | ")[0].strip("| "): row.split(" | ") for row in table.splitlines()[2:]}
    d20, d24 = cells["d20 GRPO"], cells["d24 GRPO"]
    quoted = (f"d20 {d20[3]}, d24 {d24[3]} ({d20[4]} and {d24[4]} with AC)")
    assert quoted in (REPO / "bench" / "RESULTS.md").read_text(), quoted


# Flags a script's help names that belong to another program, each with its owner.
FOREIGN_FLAGS = {"--max-restarts": "torchrun", "--init-lr-frac": "nanochat's chat_rl.py",
                 "--val_ratio": "the trainers (kat_eval --eval_holdout holds out what they held out)"}


def test_every_flag_a_scripts_help_names_is_one_it_has():
    """An option's help names only its own script's flags (or another program's, FOREIGN_FLAGS): the trainers share
    help texts, which named --optimizer and --lr_decay in kat_sft and kat_train_rm, which have neither."""
    wrong = []
    for script in SCRIPTS:
        parser = importlib.import_module(f"scripts.{script}").flags()
        for action in parser._actions:
            named = re.findall(r"(?<![\w-])(--[a-z][\w-]*[a-z0-9])", action.help or "")
            wrong += [f"{script} {action.option_strings[0]}: names {flag}" for flag in named
                      if flag not in accepted(script) and flag not in FOREIGN_FLAGS]
    assert not wrong, wrong
