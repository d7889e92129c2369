"""The GGUF file format without llama.cpp: headers, split sets, the model
identity, the architectures a split must carry, memory estimates."""
