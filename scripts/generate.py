"""Generate text with speculative decoding (the engine lands with the SpecModel issue)."""
import sys

if __name__ == "__main__":
    print("tllm_spec: the decoding engine is not built yet; this command will run the embedded demo pair.")
    sys.exit(0)
