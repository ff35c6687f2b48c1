"""The trainers people use, on a parallelized model, as they use them: transformers' ``Trainer`` with its default
``TrainingArguments`` (fused AdamW), TRL's ``SFTTrainer`` given a LoRA config (PEFT wraps the parallelized model),
and a PEFT model parallelized before the ``Trainer`` (the other order). Each trains 5 steps in a fresh process
with only ``PJRT_DEVICE``/``CPU_NUM_DEVICES`` set; the same script on the CPU (transformers told not to use
torch_xla) gives the losses to match."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ..fresh import ROOT, run_fresh

pytestmark = pytest.mark.complete

SCRIPT = r'''
import json, sys, tempfile, torch, transformers
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from trl import SFTConfig, SFTTrainer

XLA = sys.argv[1] == "xla"
if XLA:
    import xla_tp

def model():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128))

def parallel(m):
    return xla_tp.parallelize_xla(m, "auto", mesh=xla_tp.make_mesh(data=2, model=4)) if XLA else m

def lora():
    return LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0, init_lora_weights=False)

ids = torch.randint(0, 128, (40, 16), generator=torch.Generator().manual_seed(1))
rows = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
words = Tokenizer(WordLevel({f"t{i}": i for i in range(128)}, unk_token="t1"))
tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t2", unk_token="t1")
common = dict(max_steps=5, per_device_train_batch_size=8, report_to=[], logging_steps=1, save_strategy="no")

def losses(trainer):
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]

out = {}
args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), **common)
out["optim"] = getattr(args.optim, "value", args.optim)
out["trainer"] = losses(transformers.Trainer(model=parallel(model()), args=args, train_dataset=rows))
torch.manual_seed(2)
sft = SFTConfig(output_dir=tempfile.mkdtemp(), bf16=False, **common)
out["sft_lora"] = losses(SFTTrainer(model=parallel(model()), args=sft, train_dataset=rows.remove_columns("labels"),
                                    processing_class=tokenizer, peft_config=lora()))
torch.manual_seed(2)
peft_first = parallel(get_peft_model(model(), lora()))
args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), **common)
out["peft_first"] = losses(transformers.Trainer(model=peft_first, args=args, train_dataset=rows))
print("RESULT " + json.dumps(out))
'''


def _result(stdout: str) -> dict:
    return json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])


@pytest.fixture(scope="module")
def runs() -> tuple[dict, dict]:
    xla = _result(run_fresh(f"import sys; sys.argv = ['trainers', 'xla']\n{SCRIPT}", timeout=900))
    env = {key: os.environ[key] for key in ("PATH", "HOME") if key in os.environ}
    cpu = subprocess.run([sys.executable, "-c", SCRIPT, "cpu"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**env, "USE_TORCH_XLA": "0"})  # transformers' switch: the Trainer stays on the CPU
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    return xla, _result(cpu.stdout)


def test_trainer_with_default_arguments_trains_like_the_cpu_trainer(runs):
    xla, cpu = runs
    assert xla["optim"] == "adamw_torch_fused"  # the default this test is about
    assert len(xla["trainer"]) == 5
    assert xla["trainer"] == pytest.approx(cpu["trainer"], abs=1e-4)


@pytest.mark.parametrize("kind", ["sft_lora", "peft_first"])
def test_lora_in_either_order_trains_like_the_cpu(runs, kind):
    """SFTTrainer wraps the parallelized model in PEFT; ``peft_first`` parallelizes a PEFT model."""
    xla, cpu = runs
    assert len(xla[kind]) == 5
    assert xla[kind] == pytest.approx(cpu[kind], abs=1e-4)
    assert xla[kind] != pytest.approx(xla["trainer"], abs=1e-3)  # the adapters, not the whole model, trained
