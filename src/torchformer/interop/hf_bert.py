"""BERT: post-LN encoder, learned positions, token types, a LayerNorm on the embedding sum.

Checkpoints come as BertModel (keys start at ``embeddings.``, as in all-MiniLM-L6-v2) or inside a
task model (``bert.embeddings...``); both load. torchformer's Encoder returns hidden states, so
the task heads on top of them are dropped on load, deliberately and by name: the pooler
(``pooler.dense``, tanh of the first token, used by next-sentence and classification heads) and
the pre-training heads (``cls.*``). Other heads (``classifier.*``, ...) are unexpected tensors.
Export writes a BertModel folder without a pooler (transformers initialises one and says so).
"""

from __future__ import annotations

from ..configs import Learned
from .family import Family, Field, Rule
from .keymap import KeyMap
from .layouts import BERT_FIELDS, BERT_ONLY, POST_LN_ENCODER, bert_rules, body_prefix


def token_types(cfg) -> list[str]:
    # DistilBERT reproduces a BERT config without them: the choice between the two is this rule.
    return [] if cfg.n_token_types >= 1 else ["needs n_token_types >= 1"]


BERT = Family(
    model_type="bert",
    architecture="BertModel",
    fields=(*BERT_FIELDS, Field("max_position_embeddings", "max_seq_len", 512)),
    keys=lambda cfg, names: KeyMap(bert_rules(body_prefix("bert.", names))),
    rules=(Rule("token types", check=token_types),),
    fixed={**POST_LN_ENCODER, "positions": Learned()},
    written={"position_embedding_type": "absolute"},
    only=BERT_ONLY,
    ignored=(r"(bert\.)?embeddings\.position_ids", r"(bert\.)?pooler\..*", r"cls\..*"),
    generation=None,
)
FAMILIES = (BERT,)
