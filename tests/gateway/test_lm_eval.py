"""A real evaluation harness (lm-eval's `local-completions` model, its multiple-choice task
type) on a local data file, through the gateway: every log-likelihood it reads equals
transformers' sum of log-probabilities on the same checkpoint.

lm-eval is the `eval` extra (with its dependencies about 650 MB: datasets, pyarrow,
scikit-learn, ...), not part of `test`; scripts/test.sh installs it, and this test skips
without it (a plain `pytest` in a venv made without the extra). The data file
(data/multiple_choice.jsonl) was written for this test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .conftest import Stack

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's [api] extra

DATA = Path(__file__).parent / "data" / "multiple_choice.jsonl"
TASK = """task: lattice_multiple_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def test_lm_eval_multiple_choice_loglikelihoods_equal_transformers(
    stack: Stack, tmp_path, monkeypatch
):
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "lattice_multiple_choice.yaml").write_text(TASK.format(data=DATA))
    model_args = (
        f"model={stack.model_name},base_url={stack.base_url}/v1/completions,"
        f"tokenizer_backend=huggingface,tokenizer={stack.checkpoint.path},"
        f"num_concurrent=1,max_retries=1,tokenized_requests=True"
    )
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=["lattice_multiple_choice"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        batch_size=1,
        log_samples=True,
    )
    samples = results["samples"]["lattice_multiple_choice"]
    tokenizer, num_checked = stack.checkpoint.tokenizer, 0
    for sample in samples:
        for (context, continuation), response in zip(sample["arguments"], sample["resps"]):
            loglikelihood = response[0][0]
            # lm-eval's own split: the continuation is what encoding the whole adds.
            whole = tokenizer.encode(context + continuation, add_special_tokens=False)
            num_context = len(tokenizer.encode(context, add_special_tokens=False))
            with torch.no_grad():
                logits = stack.checkpoint.model(torch.tensor([whole])).logits[0]
            logprobs = torch.log_softmax(logits.double(), dim=-1)
            expected = sum(logprobs[i - 1, whole[i]].item() for i in range(num_context, len(whole)))
            assert loglikelihood == pytest.approx(expected, abs=1e-3), (context, continuation)
            num_checked += 1
    assert num_checked == sum(len(s["arguments"]) for s in samples) == 11
    assert "acc,none" in results["results"]["lattice_multiple_choice"]
