"""kvgate's vLLM KV connector: offloads KV blocks to, and loads them from, kvgate's node block
manager (``kvgate-kvbm``). The connector class is ``kvgate_vllm.connector.KvgateConnector``
(importing it needs vLLM); the other modules need only ``msgspec`` and ``xxhash``."""

__version__ = "0.1.0"
