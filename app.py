"""Kitty Lab: compare KV cache methods side by side in the browser (also the Hugging Face Spaces entry point).

    python app.py                      # http://127.0.0.1:7860, the default model
    python app.py --host 0.0.0.0       # public; or --share for a gradio.live link
    python app.py --help               # port, caps, concurrency, database, other models
"""
from app.server import main

if __name__ == "__main__":
    main()
