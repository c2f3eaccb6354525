"""What a walk hands a layer as its KV cache: a stand-in for transformers' Cache that sees the
keys and values the attention would store (`update`) and stores nothing, each batch running the
whole sequence at once. The other calls a layer makes on its cache answer as an empty cache
does: its length is 0 (MPT asks), a state it would read is absent (MiniMax's linear-attention
`get_linear_cache`), one it would store is dropped, and whether it holds one is False."""

from __future__ import annotations


class PassThroughCache:
    """An empty cache: `update` returns the keys and values as given (subclasses look at them)."""

    is_compileable = False

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        return key_states, value_states

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return 0

    def __getattr__(self, name: str):
        if name.startswith(("get_", "set_", "update_")):
            return lambda *args, **kwargs: None
        if name.startswith(("is_", "has_")):
            return lambda *args, **kwargs: False
        raise AttributeError(name)
