"""Toy models more than one test folder uses: each a minimal module with one feature of real
architectures, so that a test imports it from here, never from another test module (which
would tie the test to the order folders are collected in)."""

import torch
import torch.nn.functional as F
from torch import nn

D = 16
"""The width of the toy models."""


class LayerScale(nn.Module):
    """A pre-LN block whose branch is ``γ ⊙ (W x + b)`` (DINOv2, BEiT)."""

    def __init__(self, gamma=None, computed=False, leak=False, left=False):
        super().__init__()
        self.emb = nn.Embedding(32, D)
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.fc, self.head = nn.Linear(D, D), nn.Linear(D, 5)
        self.gamma = nn.Parameter(torch.rand(D) * 2 - 1 if gamma is None else gamma)
        self.computed, self.leak, self.left = computed, leak, left

    def forward(self, ids):
        h = self.emb(ids)
        y = self.fc(F.gelu(self.ln1(h)))
        g = self.gamma.exp() if self.computed else self.gamma
        h = h + (g * y if self.left else F.dropout(y, 0.1, training=False) * g)
        out = self.head(self.ln2(h))
        return (out, y) if self.leak else out


class Heads(nn.Module):
    """Persimmon's attention: a fused qkv projection viewed as (H, 3, D), q/k LayerNorms
    over each head's D features; v goes to the attention unnormalized."""

    def __init__(self, mix=False, fused=True, heads=2):
        super().__init__()
        self.h, self.d = heads, D // heads
        self.emb = nn.Embedding(32, D)
        self.ln_in, self.ln_f = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D) if fused else None
        self.q, self.k, self.v = (
            (nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)) if not fused else (None,) * 3
        )
        self.q_ln, self.k_ln = nn.LayerNorm(self.d), nn.LayerNorm(self.d)
        self.out, self.head = nn.Linear(D, D), nn.Linear(D, 5)
        self.mix = mix

    def forward(self, ids):
        h = self.emb(ids)
        B, T, _ = h.shape
        x = self.ln_in(h)
        if self.qkv is not None:
            qkv = self.qkv(x).view(B, T, self.h, 3, self.d)
            q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        else:
            q, k, v = (lin(x).view(B, T, self.h, self.d) for lin in (self.q, self.k, self.v))
        if self.mix:  # each row of D now holds features of both heads
            q = q.transpose(2, 3).reshape(B, T, self.h, self.d)
        q, k = self.q_ln(q), self.k_ln(k)
        att = torch.softmax(torch.einsum("bthd,bshd->bhts", q, k), -1)
        o = torch.einsum("bhts,bshd->bthd", att, v).reshape(B, T, D)
        return self.head(self.ln_f(h + self.out(o)))


def llava_siglip(**kw):
    """A tiny LLaVA whose SigLIP tower is read at layer -2 (as LLaVA-style checkpoints with SigLIP
    are), the image token the last of 128 ids."""
    import transformers

    cfg = transformers.LlavaConfig(
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        text_config=dict(
            model_type="llama",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=128,
            max_position_embeddings=128,
        ),
        image_token_index=127,
        vision_feature_layer=-2,
        vision_feature_select_strategy="full",
        **kw,
    )
    torch.manual_seed(0)
    return transformers.LlavaForConditionalGeneration(cfg).eval()


def blip2_opt(**kw):
    """A tiny BLIP-2 (ViT tower, Q-Former, OPT), its 8 query tokens placed in the text as image
    tokens, the last of 128 ids. Its tower's attention mask is read by value (``mask.all()``), so a
    meta model of it runs only where enjoyln stands zeros in for its weights."""
    import transformers

    cfg = transformers.Blip2Config(
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        qformer_config=dict(
            vocab_size=128,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            encoder_hidden_size=32,
        ),
        text_config=dict(
            model_type="opt",
            vocab_size=128,
            hidden_size=32,
            num_hidden_layers=1,
            ffn_dim=64,
            num_attention_heads=2,
            word_embed_proj_dim=32,
            max_position_embeddings=128,
        ),
        num_query_tokens=8,
        image_token_index=127,
        **kw,
    )
    torch.manual_seed(0)
    return transformers.Blip2ForConditionalGeneration(cfg).eval()
