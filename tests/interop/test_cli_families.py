"""`torchformer plan` and `generate` on a Hugging Face folder of each issue-14 part C family."""

from __future__ import annotations

import pytest
import transformers as T

from torchformer.cli.main import main
from torchformer.interop import from_hf

from . import family_checks as fc

TINY = dict(vocab_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96)
FOLDERS = {  # name -> (model class, config, whether it generates)
    "gpt_neox": (T.GPTNeoXForCausalLM, lambda: T.GPTNeoXConfig(**TINY, hidden_size=64, eos_token_id=2), True),
    "phi3": (T.Phi3ForCausalLM, lambda: T.Phi3Config(**TINY, hidden_size=64, pad_token_id=0, eos_token_id=2), True),
    "t5": (
        T.T5ForConditionalGeneration,
        lambda: T.T5Config(
            vocab_size=128,
            d_model=64,
            d_kv=16,
            d_ff=96,
            num_layers=2,
            num_heads=4,
            feed_forward_proj="gated-gelu",
            decoder_start_token_id=0,
        ),  # fmt: skip
        True,
    ),
    "roberta": (T.RobertaModel, lambda: T.RobertaConfig(**TINY, hidden_size=64, max_position_embeddings=66), False),
    "distilbert": (T.DistilBertModel, lambda: T.DistilBertConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4), False),
}


@pytest.mark.parametrize("name", list(FOLDERS))
def test_plan_and_generate_on_an_hf_folder(tmp_path, capsys, name):
    cls, config, generates = FOLDERS[name]
    fc.saved(cls, config(), tmp_path)
    assert main(["plan", str(tmp_path), "--seq-len", "32"]) == 0
    assert "parameters" in capsys.readouterr().out.lower()
    if generates:
        assert main(["generate", str(tmp_path), "--ids", "5,6,7,8", "--max-new-tokens", "4"]) == 0
        assert capsys.readouterr().out.strip()
    assert from_hf(tmp_path).config.vocab_size == 128
