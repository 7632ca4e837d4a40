"""The target model: loading, GGUF-in-a-wheel conversion, CPU kernel-path fixes."""
