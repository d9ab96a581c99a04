"""Prefill/decode (PD) disaggregation: prefill engines compute a prompt's KV, first token and
speculative carry and hand them to decode engines, which continue the request in their overlap
loop. transfer.py: the link and its backends; kv_io.py: a request's state out of and into a
worker's pools; prefill.py: PrefillEngine and PrefillServer; decode.py: DecodeEngine and the
router to prefill engines."""
