"""llama.cpp itself (llama-cpp-python): the stage context, the devices, the vocabulary, the engine slot."""
