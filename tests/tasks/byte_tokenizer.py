"""A minimal tokenizer with the task protocol (bytes), standing in for a Hugging Face one."""


class ByteTokenizer:
    vocab_size = 259
    pad_id, bos_id, eos_id = 256, 257, 258

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode()
