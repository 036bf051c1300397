"""lorakit: LoRA training for FLUX.1-dev, Qwen-Image(-Edit) and Kandinsky 5 on the machine you own."""

__version__ = "0.1.0"
