"""Tiny models trained by the single-process tests and rebuilt by tests/scripts/single_engine_resume.py.

Each model's forward(batch) returns the loss, so the DeepSpeed engine can train one more step.
"""
import torch
from torch import nn

VOCAB, WIDTH, SEQ = 32, 8, 6


class TinyLM(nn.Module):
    """Embedding tied to the output head, a LayerNorm, and an integer buffer."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, 2 * WIDTH)
        self.out = nn.Linear(2 * WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("positions", torch.arange(SEQ))

    def forward(self, tokens):
        h = self.emb(tokens)
        h = self.norm(h + self.out(torch.relu(self.mix(h))))
        logits = self.head(h)
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def tokens(seed, batch=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, SEQ), generator=g)


def gpt2_config():
    from transformers import GPT2Config
    return GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=SEQ * 2,
                      bos_token_id=0, eos_token_id=0)


def trainer_param_groups(model, weight_decay):
    """The Trainer's two groups (transformers.Trainer.create_optimizer), named."""
    from transformers import Trainer
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"names": [n for n, _ in named if n in decay], "weight_decay": weight_decay},
            {"names": [n for n, _ in named if n not in decay], "weight_decay": 0.0}]


def named_optimizer_truth(model, optimizer, state_dict):
    """{"fp32/name": param, "state/name": tensor} from an optimizer's state_dict, names found by
    parameter identity in the live optimizer (independent of reshard's mapping)."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    out = {}
    for index, entry in state_dict["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value) and value.dim() > 0:
                out[f"{key}/{order[index]}"] = value.detach().float().clone().contiguous()
    return out


def tiny_tokenizer():
    """A word-level tokenizer of VOCAB tokens ("t0".."t30", "<unk>") with a chat template, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"<unk>": VOCAB - 1}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="t0", eos_token="t0",
                                        pad_token="t0")     # the Trainer pads with it
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }} {% endfor %}"
    return tokenizer


def train_hf(out_dir, steps=3, freeze=(), tokenizer=None):
    """A real transformers.Trainer run (CPU, tiny GPT-2, in-memory data); returns (model, trainer). With
    `tokenizer` the Trainer saves it in every checkpoint."""
    from transformers import GPT2LMHeadModel, Trainer, TrainingArguments
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config())
    for name, p in model.named_parameters():
        p.requires_grad_(name not in freeze)
    data = [{"input_ids": t, "labels": t} for t in (tokens(i, batch=1)[0] for i in range(2 * steps))]
    args = TrainingArguments(output_dir=str(out_dir), max_steps=steps, save_steps=steps, per_device_train_batch_size=2,
                             learning_rate=1e-2, weight_decay=0.01, use_cpu=True, report_to=[], logging_steps=1,
                             disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    trainer.train()
    return model, trainer
