"""A tiny LightningModule (the TinyLM inside) trained by lightning.pytorch.Trainer on CPU."""
import lightning.pytorch as pl
import torch

from tests.helpers import single_models as sm


class LitTiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = sm.TinyLM()

    def forward(self, tokens):
        return self.net(tokens)

    def training_step(self, batch, batch_idx):
        return self(batch)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def train(out_dir, steps=3):
    """Fit for `steps` optimizer steps with a ModelCheckpoint; returns (module, trainer, ckpt path)."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    torch.manual_seed(0)
    module = LitTiny()
    data = torch.utils.data.DataLoader([sm.tokens(i, batch=1)[0] for i in range(2 * steps)], batch_size=2)
    checkpoint = ModelCheckpoint(dirpath=str(out_dir), every_n_train_steps=steps, save_top_k=-1)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[checkpoint])
    trainer.fit(module, data)
    return module, trainer, checkpoint.best_model_path or checkpoint.last_model_path
