"""Leviathan: a LLaMA-style language model whose input embedding table is replaced by LEV, a
tiny continuous generator from token id to vector, with an untied output head.

Paper: R. T. Batley and S. Saha, "Leviathan: Decoupling Input and Output Representations in
Language Models", arXiv 2601.22040. The authors released no code: each detail the paper leaves
open is reconstructed, flagged (R) where the choice is made, and given its reason there.

Read top to bottom: LEV as the method's equations, the configuration, the backbone, the model with
its three arms (lev / tied / untied), generation; then an appendix that exists only for speed and
memory (skip it on a first reading). Imports only torch: copy this file alone. Sizes: train.py.
"""
import contextlib
import functools
import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

# -------------------------------------------------------------------- LEV: token id i -> E_i in R^D

def lev_base(vocab_size, digits):
    """Smallest base b with b**k >= V, so every id has exactly k base-b digits.
    Integer arithmetic: a float ceil(V ** (1/k)) can be off by one at exact powers."""
    b = max(2, round(vocab_size ** (1.0 / digits)) - 1)
    while b**digits < vocab_size:
        b += 1
    return b

def to_digits(ids, base, digits):
    """Step 1: i = sum_j i_j * b^(k-1-j). Returns [..., k], most significant first."""
    powers = base ** torch.arange(digits - 1, -1, -1, device=ids.device)
    return (ids.unsqueeze(-1) // powers) % base

def bspline_basis(t, knots):
    """Step 3c: B_m(t) = beta((t - g_m)(kappa - 1)) on the knots g_m = m / (kappa - 1), for every
    m: [...] -> [..., kappa]. beta is the centred quadratic B-spline: 0.75 - x^2 for |x| < 0.5,
    (1.5 - |x|)^2 / 2 for |x| < 1.5, else 0; at most 3 of the kappa values are non-zero.
    (R) Normalised to a partition of unity: at the two end knots a neighbour falls outside
    [0, 1], and the raw sum would dip to 0.875 there."""
    x = t.unsqueeze(-1) * (knots - 1) - torch.arange(knots, device=t.device)  # (t - g_m)(kappa - 1)
    beta = torch.where(x.abs() < 0.5, 0.75 - x**2,
                       torch.where(x.abs() < 1.5, 0.5 * (1.5 - x.abs()) ** 2, 0.0))
    return beta / beta.sum(-1, keepdim=True)

class LEV(nn.Module):
    """Learned embedding vectorization: i -> digits (i_1..i_k) -> z = sum_j C_j[i_j]
      -> per head l: t = sigmoid(LayerNorm_l(W_l z) / 2), phi_d = sum_m B_m(t_d) S_l[d, m]
      -> M_l = prod_d phi_d (element-wise in r) -> E_i = sum_l W_out_l M_l.
    generate_reference is these equations written out; generate, the same on the fast path."""

    def __init__(self, vocab_size, d_model, digits=3, seed_dim=128, heads=8, knots=16, rank=64,
                 sigmoid_scale=0.5):
        super().__init__()
        self.vocab_size, self.digits, self.knots = vocab_size, digits, knots
        self.sigmoid_scale = sigmoid_scale
        self.base = lev_base(vocab_size, digits)
        self.codebooks = nn.Parameter(torch.empty(digits, self.base, seed_dim))  # C_1..C_k
        self.seed_proj = nn.Parameter(torch.empty(heads, seed_dim, seed_dim))  # W_l, no bias
        self.norm_weight = nn.Parameter(torch.empty(heads, seed_dim))  # LayerNorm_l's weight
        self.norm_bias = nn.Parameter(torch.empty(heads, seed_dim))  # and bias
        self.spline = nn.Parameter(torch.empty(heads, seed_dim, knots, rank))  # S_l
        self.out_proj = nn.Parameter(torch.empty(heads, rank, d_model))  # W_out_l
        self.reset_parameters()

    @classmethod
    def from_config(cls, cfg):
        """The LEV of a model Config (its vocabulary, width and lev_* fields)."""
        return cls(cfg.vocab_size, cfg.d_model, cfg.lev_digits, cfg.lev_seed_dim, cfg.lev_heads,
                   cfg.lev_knots, cfg.lev_rank, cfg.lev_sigmoid_scale)

    @torch.no_grad()
    def reset_parameters(self):
        # (R) Init so the product of d_seed=128 factors stays near 1: each phi_d is a convex mix of
        # S entries around 1, so log|phi_d| ~ N(0, 0.06^2) and M_l ~ exp(N(-0.2, 0.7^2)), neither 0
        # nor inf; E_i's entries then have std ~0.23 (V = 8192, D = 128). Every block normalises
        # its input, so E's scale only sets how much it outweighs the first residual updates.
        heads = self.seed_proj.shape[0]
        nn.init.normal_(self.codebooks, std=0.02)
        nn.init.normal_(self.seed_proj, std=0.02)
        nn.init.ones_(self.norm_weight)
        nn.init.zeros_(self.norm_bias)
        nn.init.normal_(self.spline, mean=1.0, std=0.1)
        nn.init.normal_(self.out_proj, std=0.02 / math.sqrt(heads))

    def coordinates(self, ids):
        """Steps 1-3b, shared by both paths: ids [N] -> t [h, N, d_seed], every t_d in (0, 1)."""
        digits = to_digits(ids, self.base, self.digits)  # 1: [N, k]
        # 2: z [N, d_seed]. F.embedding, not C[j, digits]: indexing's backward adds the gradients
        # of repeated digits in a varying order on a multi-threaded CPU (not bit-exact)
        z = sum(F.embedding(digits[:, j], self.codebooks[j]) for j in range(self.digits))
        u = torch.einsum("nd,hde->hne", z, self.seed_proj)  # 3a: W_l z, every head l at once
        u = F.layer_norm(u, u.shape[-1:], eps=1e-5)
        u = u * self.norm_weight[:, None] + self.norm_bias[:, None]  # LayerNorm_l's weight, bias
        # 3b. (R) t = sigmoid(u / 2), the 1/2 of the one reimplementation that cites the paper's
        # Sec. 3.1: with LayerNorm's weight at 1, +-1 sigma of u then spans ~3.7 of the 15 knot
        # intervals instead of ~6.9. sigmoid_scale=1 is the form without it.
        return torch.sigmoid(self.sigmoid_scale * u)

    def generate_reference(self, ids):
        """E_i for a 1-D tensor of ids, [N] -> [N, D], straight from the equations, with all of B
        and phi ([h, N, d_seed, kappa or r]) kept by autograd. Slow and memory-hungry: read this
        one. (R) M_l in log space: a plain product of d_seed factors can leave float32's range."""
        t = self.coordinates(ids)  # 1-3b: [h, N, d_seed]
        basis = bspline_basis(t, self.knots)  # 3c: [h, N, d_seed, kappa]
        phi = torch.einsum("hndm,hdmr->hndr", basis, self.spline)  # 3d: sum_m B_m(t_d) S_l[d, m]
        modes = phi.sign().prod(2) * phi.abs().log().sum(2).exp()  # 3e: sign * exp(sum log|phi|)
        return torch.einsum("hnr,hrD->nD", modes, self.out_proj)  # 3f, 4: E_i = sum_l W_out_l M_l

    def generate(self, ids):
        """generate_reference's E_i, its product M_l (steps 3c-3e) by separable_modes, which never
        writes phi. (R) In float32, even under bf16 autocast: LEV is tiny in FLOPs, but a product of
        d_seed factors each rounded to bf16's 8-bit mantissa loses most of its precision. The output
        is float32, as an nn.Embedding lookup stays float32 under autocast."""
        with torch.autocast(ids.device.type, enabled=False):
            t = self.coordinates(ids).permute(2, 0, 1).contiguous()  # 1-3b: [d_seed, h, N]
            modes = separable_modes(t, self.spline)  # 3c-3e: M_l, [h, N, r]
            return torch.einsum("hnr,hrD->nD", modes, self.out_proj)  # 3f, 4

    def forward(self, ids, distinct=None):
        """ids of any shape -> [..., D]. LEV depends only on the id, so it runs once per *distinct*
        id of the batch (~30k in 262k o200k tokens), then is gathered back. distinct: the ids'
        distinct_ids(), when the caller has made them (training does, on the CPU)."""
        rows, inverse = distinct if distinct is not None else distinct_ids(ids)
        # F.embedding, not generate(rows)[inverse]: bit-exact gradients (see coordinates)
        return F.embedding(inverse, self.generate(rows))

    @torch.no_grad()
    def as_table(self, chunk=1024):
        """LEV for the whole vocabulary, in chunks: at inference, an ordinary [V, D] table."""
        ids = torch.arange(self.vocab_size, device=self.out_proj.device)
        return torch.cat([self.generate(c) for c in ids.split(chunk)])

# ------------------------------------------------------------------------------------ configuration

EMBEDDINGS = ("lev", "tied", "untied")  # Leviathan | the paper's baseline | the ablation it lacks

@dataclass(frozen=True)
class Config:
    vocab_size: int = 200_064  # o200k_base's 200,019 ids padded to a multiple of 128
    d_model: int = 2048  # D
    n_layer: int = 16
    n_head: int = 16
    seq_len: int = 512  # the paper's v1 sequence length
    embedding: str = "lev"  # one of EMBEDDINGS
    rope_theta: float = 10_000.0
    lev_digits: int = 3  # k
    lev_seed_dim: int = 128  # d_seed
    lev_heads: int = 8  # h
    lev_knots: int = 16  # kappa
    lev_rank: int = 64  # r
    lev_sigmoid_scale: float = 0.5  # 3b: t = sigmoid(scale * u); (R) 1/2, see LEV.coordinates
    def __post_init__(self):
        """Refuse shapes that would crash later or train something that is not the method."""
        def check(ok, name, rule):
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)}: {rule}")
        if self.embedding not in EMBEDDINGS:
            raise ValueError(f"embedding must be one of {', '.join(EMBEDDINGS)}, "
                             f"got {self.embedding!r}")
        # LayerNorm needs 2 coordinates of z; a quadratic B-spline 3 knots, or every id embeds alike
        for name, least in dict(vocab_size=2, d_model=2, n_layer=1, n_head=1, seq_len=1,
                                lev_digits=1, lev_seed_dim=2, lev_heads=1, lev_knots=3,
                                lev_rank=1).items():
            value = getattr(self, name)
            check(isinstance(value, int) and value >= least, name, f"must be an integer >= {least}")
        # the rotary base is used in float32: past its range the tables would hold inf and nan
        check(0 < self.rope_theta <= torch.finfo(torch.float32).max, "rope_theta",
              "must be > 0 and finite in float32")
        check(0 < self.lev_sigmoid_scale < math.inf, "lev_sigmoid_scale", "must be > 0 and finite")
        check(self.d_model % (2 * self.n_head) == 0, "d_model",
              f"must split into n_head={self.n_head} even-sized heads (rotary embeddings rotate "
              "pairs of dimensions)")
        V, k = self.vocab_size, self.lev_digits
        base = lev_base(V, k)  # the leading digit is 0 for every id unless base^(k-1) < V
        check(base ** (k - 1) < V, "lev_digits", f"{V:,} ids have fewer than {k} digits in base "
              f"{base} (the leading one would be 0 for every id)")
    @property
    def ffn_dim(self):
        """SwiGLU hidden size: 8/3 D (the parameters of a 4D GELU MLP), rounded up to 128."""
        return -(-8 * self.d_model // 3 // 128) * 128
    @classmethod
    def from_options(cls, options, n_ids):
        """The Config of a tokenizer of n_ids ids (padded_vocab) whose other fields are options'
        attributes of the same names: what train.py builds from its options."""
        shape = {f.name: getattr(options, f.name) for f in fields(cls) if f.name != "vocab_size"}
        return cls(vocab_size=padded_vocab(n_ids), **shape)

def padded_vocab(n_ids):
    """n_ids rounded up to a multiple of 128 (tensor cores); padding ids are never sampled."""
    return -(-n_ids // 128) * 128

# ------------------------------------------------------------- the backbone: LLaMA-style, no biases

def rotary_tables(seq_len, head_dim, theta):
    """cos/sin of the rotation angle pos * theta^(-2j/head_dim), each [seq_len, head_dim/2]."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len).float(), inv_freq)
    return angles.cos(), angles.sin()

def apply_rotary(x, cos, sin):
    """Rotate each pair (x_j, x_{j+hd/2}) by its angle. x: [B, H, T, hd]."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

class KVCache:
    """One layer's keys and values so far: a new token costs one position, not a rerun. One object
    a layer, not one index into a shared tensor: a compiled block then serves every layer."""
    def __init__(self, batch, n_head, max_len, head_dim, device, dtype):
        shape = (batch, n_head, max_len, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0  # positions filled; also the rotary position of the next token
    def update(self, k, v):
        start, end = self.length, self.length + k.shape[2]
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.d_model // cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
    def forward(self, x, cos, sin, cache=None):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            start = cache.length
            k, v = cache.update(k, v)
            # new query t (at position start + t) may see cached keys 0..start + t
            mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(start)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))

class SwiGLU(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.ffn_dim, bias=False)
        self.down = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)
    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)

class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn_norm, self.attn = nn.RMSNorm(cfg.d_model, eps=1e-6), Attention(cfg)
        self.mlp_norm, self.mlp = nn.RMSNorm(cfg.d_model, eps=1e-6), SwiGLU(cfg)
    def forward(self, x, cos, sin, cache=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, cache)
        return x + self.mlp(self.mlp_norm(x))

# ----------------------------------------------------------- the model: embedding -> blocks -> head

def cross_entropy_reference(x, weight, targets, reduction="mean"):
    """The loss as written: cross-entropy of the whole logits z = x W^T, [N, D] -> their mean, or
    with reduction="none" each position's, [N]. Model.forward calls linear_cross_entropy (in the
    appendix), which computes this chunk by chunk, never holding the [N, V] logits and their
    gradient at once; the tests hold the two equal, in value and in dL/dx and dL/dW."""
    return F.cross_entropy(F.linear(x, weight).float(), targets, reduction=reduction)

class Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        if cfg.embedding == "lev":
            self.lev = LEV.from_config(cfg)
        else:
            self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.d_model, eps=1e-6)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.embedding == "tied":
            self.head.weight = self.embed.weight  # one V x D matrix, used twice
        cos, sin = rotary_tables(cfg.seq_len, cfg.d_model // cfg.n_head, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.frozen_table = None  # set by freeze_lev() for inference
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """Matrices N(0, 0.02), the two residual outputs per block (attn.proj, mlp.down) scaled by
        1/sqrt(2 n_layer) so the residual stream does not grow with depth. tied: the shared table
        N(0, 0.02) serves both sides, as in GPT-2. untied / lev: the head starts at zero, so the
        first prediction is uniform (loss = ln V) and the head has no random noise to unlearn;
        the untied table keeps N(0, 0.02), so both lookup arms start alike."""
        for name, p in self.named_parameters():
            if name.startswith("lev.") or p.dim() < 2:
                continue  # LEV inits itself; norm weights stay at 1
            residual_out = name.endswith(("proj.weight", "down.weight"))
            std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if residual_out else 0.02
            nn.init.normal_(p, std=std)
        if self.cfg.embedding != "tied":
            nn.init.zeros_(self.head.weight)

    def forward(self, idx, targets=None, cache=None, reduction="mean", distinct=None):
        """idx [B, T] -> float32 logits [B, T, V] for every position; with targets, the
        cross-entropy instead (the mean, or per token [B, T] with reduction="none"). cache:
        new_cache()'s, which idx extends. distinct: distinct_ids(idx), made by the caller (LEV only;
        see LEV.forward)."""
        start = cache[0].length if cache is not None else 0
        if start + idx.shape[1] > self.cfg.seq_len:
            raise ValueError(f"{start + idx.shape[1]} positions exceed seq_len={self.cfg.seq_len}")
        cos = self.rope_cos[start:start + idx.shape[1]]
        sin = self.rope_sin[start:start + idx.shape[1]]
        if self.frozen_table is not None:  # LEV made once for every id (freeze_lev)
            x = F.embedding(idx, self.frozen_table)
        else:
            x = self.lev(idx, distinct) if self.cfg.embedding == "lev" else self.embed(idx)
        for block, layer_cache in zip(self.blocks, cache or [None] * len(self.blocks), strict=True):
            x = block(x, cos, sin, layer_cache)
        x = self.norm(x)
        if targets is None:
            return self.head(x).float()
        # cross_entropy_reference's loss, chunked so that the [tokens, V] logits never exist
        losses = linear_cross_entropy(x.flatten(0, 1), self.head.weight, targets.flatten(),
                                      reduction=reduction)
        return losses.view(targets.shape) if reduction == "none" else losses

    def new_cache(self, batch):
        """forward's cache: a KVCache for each block."""
        p, head_dim = self.head.weight, self.cfg.d_model // self.cfg.n_head
        return [KVCache(batch, self.cfg.n_head, self.cfg.seq_len, head_dim, p.device, p.dtype)
                for _ in self.blocks]

    def compile(self, dynamic=None, **options):
        """torch.compile in place (same state_dict keys), block by block: every block runs the same
        code on weights of the same shapes, so the graph compiled for the first serves all n_layer.
        The whole model as one graph would be traced through every block, and under DDP cut at each
        of its gradient buckets (~200 at 1.2b): minutes of compiling on every rank at every start.
        (DDP cuts a block's graph too, in ~8 at 1.2b, once for all.) Also compiled: compile_lev."""
        if self.cfg.embedding == "lev":
            compile_lev(self.lev, **options)
        for block in self.blocks:
            block.compile(dynamic=dynamic, **options)

    @torch.no_grad()
    def freeze_lev(self):
        """Inference: evaluate LEV once for every id and use it as a lookup table."""
        if self.cfg.embedding == "lev":
            self.frozen_table = self.lev.as_table()

    def param_counts(self):
        """Parameters by role. The tied table is counted once, as input."""
        def count(module):
            return sum(p.numel() for p in module.parameters())
        embed = self.lev if self.cfg.embedding == "lev" else self.embed
        head = 0 if self.cfg.embedding == "tied" else self.head.weight.numel()
        backbone = count(self.blocks) + count(self.norm)
        return {"input": count(embed), "backbone": backbone, "head": head,
                "total": count(embed) + backbone + head}

    def flops_per_token(self):
        """Training FLOPs per token: 6 per backbone and head weight (LEV runs once per distinct
        id, a lookup is free), plus attention's QK^T and AV, 12 n_layer D seq_len."""
        counts = self.param_counts()
        matmul_params = counts["backbone"] + self.head.weight.numel()
        return 6 * matmul_params + 12 * self.cfg.n_layer * self.cfg.d_model * self.cfg.seq_len

    def configure_optimizers(self, lr, weight_decay, betas=(0.9, 0.95), fused=False,
                             lr_input=1.0, lr_head=1.0):
        """AdamW; the training loop multiplies each group's `lr_scale` into the scheduled rate.
        - backbone: matrices decayed, norm weights (scales) not; lr_scale 1.
        - input side (LEV or the untied table): lr_scale lr_input, no decay. LEV's output is a
          product of 128 factors near 1, so decay would shrink M_l exponentially; a rare token's
          table row gets few gradients, and decay would erase it between them.
        - untied head: lr_scale lr_head, decayed. It starts at zero and wants a higher rate.
        The tied table is both input and head: one group, decayed, lr_scale lr_input."""
        tied = self.cfg.embedding == "tied"
        backbone = [p for n, p in self.named_parameters() if n.startswith(("blocks.", "norm."))]
        input_side = list((self.embed if self.cfg.embedding != "lev" else self.lev).parameters())
        groups = [
            dict(params=[p for p in backbone if p.dim() >= 2], weight_decay=weight_decay,
                 lr_scale=1.0),
            dict(params=[p for p in backbone if p.dim() < 2], weight_decay=0.0, lr_scale=1.0),
            dict(params=input_side, weight_decay=weight_decay if tied else 0.0, lr_scale=lr_input),
        ]
        if not tied:
            head = dict(params=[self.head.weight], weight_decay=weight_decay, lr_scale=lr_head)
            groups.append(head)
        for group in groups:
            group["lr"] = lr * group["lr_scale"]
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused)

def precision(device, bf16=None):
    """The context the model trains and runs in: bf16 autocast on a GPU (LEV and the softmax stay
    float32 inside it), float32 on a CPU; bf16 overrides."""
    device_type = torch.device(device).type
    on = device_type == "cuda" if bf16 is None else bf16
    return torch.autocast(device_type, dtype=torch.bfloat16) if on else contextlib.nullcontext()

# --------------------------------------------------------------------------------------- generation

def sample_next(logits, temperature=1.0, top_k=0, top_p=1.0, generator=None, n_valid=None):
    """One token id from last-position logits [V]. temperature 0 = greedy; top_k 0 and
    top_p 1 switch those filters off. Ids >= n_valid are padding rows of the head that the
    tokenizer cannot decode: a trained model gives them low scores, but not -inf."""
    logits = logits.float().clone()
    if n_valid is not None:
        logits[n_valid:] = float("-inf")
    if temperature == 0:
        return int(logits.argmax())
    # softmax(z / T) = softmax((z - max z) / T): shifted first where z / T overflows float32 (a
    # tiny T), which would leave softmax inf - inf = nan
    scaled = logits / temperature
    logits = scaled if scaled.max() < math.inf else (logits - logits.max()) / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        # Nucleus: the ids up to mass top_p and the one crossing it (the top one, even at top_p 0)
        probs, order = torch.sort(torch.softmax(logits, -1), descending=True)
        outside = probs.cumsum(-1) - probs >= top_p
        outside[0] = False
        logits[order[outside]] = float("-inf")
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))

def generate_text(model, prompt_ids, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0,
                  generator=None, stop_id=None, n_valid=None):
    """Iterator over up to max_new_tokens new ids that continue prompt_ids (a list of ints,
    1 to seq_len of them). It ends early when stop_id is sampled (stop_id is not yielded)."""
    if not 1 <= len(prompt_ids) <= model.cfg.seq_len:
        raise ValueError(f"the prompt must be 1 to seq_len={model.cfg.seq_len} tokens, "
                         f"got {len(prompt_ids)}")
    return _generate_text(model, list(prompt_ids), max_new_tokens, temperature, top_k, top_p,
                          generator, stop_id, n_valid)

def _generate_text(model, tokens, max_new_tokens, temperature, top_k, top_p, generator, stop_id,
                   n_valid):
    device, seq_len = model.head.weight.device, model.cfg.seq_len
    # The model sees at most seq_len tokens, tokens[start:]; when one more would not fit, the window
    # jumps to the last seq_len // 2. Cached keys carry their rotary positions, so a window sliding
    # by one token would re-read it all at every step (no faster than no cache); jumping by half
    # re-reads seq_len/2 tokens once per seq_len/2 new ones, about one extra position per token.
    keep = max(1, seq_len // 2)
    start, cache = 0, None
    for _ in range(max_new_tokens):
        if len(tokens) - start > seq_len:
            start, cache = len(tokens) - keep, None
        if cache is None:  # (re)fill: the whole window at once, from position 0
            cache, new = model.new_cache(1), tokens[start:]
        else:  # the cache holds tokens[start:-1]; feed only the last one
            new = tokens[-1:]
        # no_grad around the forward only: grad mode must not leak to the caller between yields
        with torch.no_grad():
            logits = model(torch.tensor([new], device=device), cache=cache)[0, -1]
        next_id = sample_next(logits, temperature, top_k, top_p, generator, n_valid)
        if next_id == stop_id:
            return
        tokens.append(next_id)
        yield next_id

# ==================================================================================================
# Appendix: speed and memory only (skip on a first reading). Nothing below changes what the model
# computes: the tests hold each fast form to its plain one above, in value and gradient.

# ------------------------------------------------------------------------------------- distinct ids

def distinct_ids(ids):
    """(rows, inverse): the distinct ids, sorted and padded with id 0, and each position's row.
    torch.unique's output size is known only once it has run (on a GPU the host waits for the
    device there), so training calls this on the CPU, where the batch starts."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    # Rows for n distinct ids: n rounded up to 5, 6, 7 or 8 times a power of two (<= 25% more), so
    # the compiled generator meets 4 shapes per doubling of n, not a new one every batch, and sums
    # in the same block sizes whenever a size comes back. Extra rows get no gradient.
    n = len(unique)
    step = 1 << max(0, (n - 1).bit_length() - 3)
    rows = -(-n // step) * step
    return F.pad(unique, (0, rows - n)), inverse

# -------------------------------------------------------------------- kernels compiled on their own
FUSE_MIN_FLOATS = 1 << 20  # floats of phi, or of a chunk's logits

# Failures of compiling itself, by name (an older torch lacks some). What a compiled kernel raises
# as it runs (out of memory, a bad index) is a fault to see, not caught.
COMPILE_FAILURES = tuple(getattr(torch._dynamo.exc, name) for name in
                         ("BackendCompilerFailed", "ShortenTraceback", "Unsupported",
                          "InternalTorchDynamoError", "FailOnRecompileLimitHit")
                         if hasattr(torch._dynamo.exc, name))

class Fused:
    """fn compiled into fused kernels (C++ on a CPU, Triton on a GPU); where compiling fails (no C++
    compiler, an unsupported GPU), fn eagerly, with one warning line per `what` (LEV, the loss)."""
    warned = set()  # the `what`s that have printed their warning
    def __init__(self, fn, what):
        self.fn, self.what = fn, what
        # split_reductions off: the first call's hints (others on a resume) may split a sum in two
        self.compiled = torch.compile(fn, dynamic=True, fullgraph=True,
                                      options={"split_reductions": False})
    def __call__(self, *args):
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except COMPILE_FAILURES as error:
                if self.what not in Fused.warned:
                    cause = getattr(error, "inner_exception", error)  # what inductor raised
                    reason = f"{type(cause).__name__}: {cause}".split("\n")[0]
                    print(f"warning: {self.what} runs eagerly (slower); torch.compile failed: "
                          f"{reason}")
                    Fused.warned.add(self.what)
                self.compiled = None
        return self.fn(*args)

# ------------------------------------------------------------------------- LEV's steps 3c-3e, fused
# Written out, they keep a dense basis [h, N, d_seed, kappa] and phi [h, N, d_seed, r] for the
# backward: ~1 GB for a few hundred ids at the paper's sizes. Here only the 3 non-zero B_m(t_d)
# are made; phi_d mixes 3 rows of S (float32 multiply-adds, exact on any device) in registers, and
# the backward makes it again from t; only t, S and M are saved.

def bspline_nonzero(t, knots):
    """Step 3c, the non-zero part: beta vanishes for |x| >= 1.5, so only the knot nearest to t and
    its two neighbours have B_m(t) > 0. With f = t (kappa - 1) - nearest in [-0.5, 0.5] these are
    beta(f + 1) = (0.5 - f)^2 / 2, beta(f) = 0.75 - f^2, beta(f - 1) = (0.5 + f)^2 / 2. Returns, one
    plane per knot (nearest - 1, nearest, nearest + 1): its index m (int32), B_m(t) and dB_m/dt."""
    position = t * (knots - 1)
    nearest = position.round()
    f = position - nearest
    per_plane = (3,) + (1,) * t.dim()  # one value per plane, the same over t
    # the three planes' beta as constant + linear * f + square * f^2
    constant, linear, square = [torch.tensor(c, dtype=t.dtype, device=t.device).view(per_plane)
                                for c in ([0.125, 0.75, 0.125], [-0.5, 0.0, 0.5], [0.5, -1.0, 0.5])]
    neighbours = nearest + torch.arange(-1, 2, device=t.device).view(per_plane)
    inside = (neighbours >= 0) & (neighbours < knots)
    values = (constant + linear * f + square * f**2) * inside
    slopes = (linear + 2 * square * f) * inside * (knots - 1)
    # (R) Normalised as in bspline_basis: at the two end knots a neighbour falls outside [0, kappa).
    total = values.sum(0)
    values = values / total
    slopes = (slopes - values * slopes.sum(0)) / total  # quotient rule; slopes.sum(0) = 0 inside
    return neighbours.clamp_(0, knots - 1).int(), values, slopes

def mixed_rows(spline, index, *weights):
    """sum_j w[j] S_l[d, index[j]], [d, h, N, r], for each w of weights (B_m(t_d): phi_d; dB_m/dt_d:
    dphi_d/dt_d). Compiled, the rows of S are loads inside the kernel, never written to memory."""
    heads, seed_dim = spline.shape[:2]
    d = torch.arange(seed_dim, device=index.device).view(-1, 1, 1)
    head = torch.arange(heads, device=index.device).view(1, -1, 1)
    rows = [spline[head, d, index[j]] for j in range(3)]
    return [sum(row * w[j, ..., None] for j, row in enumerate(rows)) for w in weights]

def group_products(index, values, spline, group):
    """Steps 3d and part of 3e for a chunk of coordinates: phi_d = m_d 2^(e_d), |m_d| in [0.5, 1)
    (frexp), and per group of `group` coordinates (prod_d m_d, sum_d e_d). A product of <= 126 such
    mantissas stays in float32's range, so it rounds as a plain product would had that stayed in
    range; checking a plain product's range instead would make a GPU wait."""
    (phi,) = mixed_rows(spline, index, values)
    mantissas, exponents = torch.frexp(phi)
    return mantissas.unflatten(0, (-1, group)).prod(1), exponents.unflatten(0, (-1, group)).sum(1)

def product_gradients(index, values, slopes, spline, grad_times_modes):
    """The backward of M_l = prod_d phi_d for a chunk of coordinates, with G M = dL/dM * M:
    q_d = dL/dphi_d = G M / phi_d, dL/dt_d = <q_d, dphi_d/dt_d> (reduced over r as it is made), and
    the dense basis B_m(t_d), [d, h, N, kappa]: dL/dS_l[d, m] = sum_n B_m(t_d) q_d, a matmul."""
    phi, phi_slope = mixed_rows(spline, index, values, slopes)
    q = grad_times_modes / phi
    knots = torch.arange(spline.shape[2], device=index.device)
    basis = sum(values[j, ..., None] * (index[j, ..., None] == knots) for j in range(3))
    return q, (q * phi_slope).sum(-1), basis

# LEV's kernels, and the same Fused, for a call big enough (FUSE_MIN_FLOATS) to repay compiling
KERNELS = bspline_nonzero, group_products, product_gradients
FUSED_KERNELS = tuple(Fused(kernel, "LEV") for kernel in KERNELS)

# Floats of phi per chunk of seed coordinates. CPU, 4 MB: the backward's q_d is still in cache
# when the matmul reads it. GPU, 256 MB: each chunk costs kernel launches.
CHUNK_FLOATS_CPU, CHUNK_FLOATS_GPU = 1 << 20, 1 << 26

def seed_chunks(t, rank, multiple=1):
    """Slices of the seed coordinates d, each a multiple of `multiple` long."""
    seed_dim, heads, n = t.shape
    budget = CHUNK_FLOATS_CPU if t.device.type == "cpu" else CHUNK_FLOATS_GPU
    size = max(1, budget // (heads * n * rank)) // multiple * multiple or multiple
    return [slice(d, min(d + size, seed_dim)) for d in range(0, seed_dim, size)]

class SeparableProduct(torch.autograd.Function):
    """Steps 3c-3e: t [d_seed, h, N], S [h, d_seed, kappa, r] -> M_l = prod_d phi_d, [h, N, r].
    (R) M is carried as mantissa * 2^exponent: sign * exp(sum_d log|phi_d|) exactly, with no
    logarithm per factor and nothing to check. The backward makes phi again and writes q_d, which
    the matmul for dL/dS needs (with TF32 on, that matmul rounds like the rest of the backward)."""
    @staticmethod
    def forward(ctx, t, spline):
        seed_dim, heads, n = t.shape
        group = max(g for g in range(1, 65) if seed_dim % g == 0)  # <= 64 mantissas: >= 2^-64
        mantissa = t.new_ones(heads, n, spline.shape[-1])
        exponent = torch.zeros(mantissa.shape, dtype=torch.int32, device=t.device)
        ctx.kernels = FUSED_KERNELS if t.numel() * spline.shape[-1] >= FUSE_MIN_FLOATS else KERNELS
        bspline, products, _ = ctx.kernels
        index, values, _ = bspline(t, spline.shape[2])
        for d in seed_chunks(t, spline.shape[-1], group):
            mantissas, exponents = products(index[:, d], values[:, d], spline[:, d], group)
            for group_mantissa, group_exponent in zip(mantissas.unbind(0), exponents.unbind(0)):
                # the running product's scale moves into the integer exponent: never out of range
                mantissa, scale = torch.frexp(mantissa * group_mantissa)
                exponent = exponent + scale + group_exponent
        modes = torch.ldexp(mantissa, exponent)
        ctx.save_for_backward(t, spline, modes)
        return modes
    @staticmethod
    def backward(ctx, grad_modes):
        t, spline, modes = ctx.saved_tensors
        grad_t, grad_spline = torch.empty_like(t), torch.empty_like(spline)
        grad_times_modes = (grad_modes * modes).contiguous()  # dL/dM * M, the same for every d
        bspline, _, gradients = ctx.kernels
        index, values, slopes = bspline(t, spline.shape[2])
        for d in seed_chunks(t, spline.shape[-1]):
            q, grad_t[d], basis = gradients(index[:, d], values[:, d], slopes[:, d], spline[:, d],
                                            grad_times_modes)
            grad_spline[:, d] = (basis.transpose(-1, -2) @ q).transpose(0, 1)
        return grad_t, grad_spline

separable_modes = torch.compiler.disable(SeparableProduct.apply)  # never traced: see the end

# -------------------------------------------------------------------------------- the loss, chunked
# Whole, logits, log-softmax and gradient are three float32 [N, V]: ~20 GB for 8,192 tokens at
# V = 200k. A chunk's logits give its loss and, at once, dL/dx = G W and dL/dW = G^T x with
# G = (softmax - onehot) / N; backward only scales them by dLoss.

LOSS_CHUNK_LOGITS = 1 << 28  # 1 GiB of float32 logits: fewer chunks, fewer passes over dL/dW

def loss_chunks(n, vocab_size):
    step = max(1, LOSS_CHUNK_LOGITS // vocab_size)
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]

def softmax_gradient_(logits, targets, n):
    """The loss's elementwise work on one chunk, in place: the logits z [chunk, V] become
    G = (softmax(z) - onehot) / n, dLoss/dz for the mean over n positions; returns the chunk's
    summed loss, sum(logsumexp(z) - z_target). In float32, whatever the logits' dtype."""
    z = logits.float()  # float32 logits: z is the logits themselves, and every step is in place
    top = z.amax(-1, keepdim=True)
    target_z = z.gather(1, targets[:, None])
    exps = z.sub_(top).exp_()  # exp(z - max): nothing overflows
    sums = exps.sum(-1, keepdim=True)
    loss = (sums.log() + top - target_z).sum()
    g = exps.div_(sums * n)
    g.scatter_add_(1, targets[:, None], torch.full_like(target_z, -1.0 / n))  # - onehot / n
    logits.copy_(g)  # back into the logits' dtype (float32: a copy onto itself, skipped)
    return loss

def fused_softmax_gradient_(logits, targets, n):
    """softmax_gradient_ for fused kernels, equal up to rounding: exp(z - lse) is made again where
    G is written, so each logit is read three times (max, sum, G) and written once, not the ~9
    passes of eager ops."""
    z = logits.float()
    top = z.amax(-1, keepdim=True)
    lse = top + (z - top).exp().sum(-1, keepdim=True).log()  # logsumexp(z), [chunk, 1]
    loss = (lse - z.gather(1, targets[:, None])).sum()  # before z is overwritten
    onehot = torch.arange(z.shape[1], device=z.device) == targets[:, None]
    logits.copy_(((z - lse).exp() - onehot.float()) / n)
    return loss

FUSED_SOFTMAX = Fused(fused_softmax_gradient_, "the loss")

@functools.cache
def adds_bf16_products_into_float32(device):
    """Whether torch.addmm here adds a bf16 product into a float32 matrix in place (out_dtype:
    CUDA, in recent torch), checked on a small case against the product made apart. Autocast is
    off: the loss, which asks first, runs under it, and it would make that product in bf16."""
    with torch.autocast(device.type, enabled=False):
        a, b = (torch.linspace(-2, 2, 64 * n, device=device).view(64, n).to(torch.bfloat16)
                for n in (32, 16))  # not random: training's random numbers stay as they were
        total = torch.linspace(-5, 5, 32 * 16, device=device).view(32, 16)
        want = total + a.t().float() @ b.float()  # bf16 values are exact in float32 (and TF32)
        try:
            torch.addmm(total, a.t(), b, out_dtype=torch.float32, out=total)
        except (TypeError, RuntimeError, NotImplementedError):  # no out_dtype, or not these dtypes
            return False
        return torch.allclose(total, want, rtol=1e-4, atol=1e-4)

# ----------------------------------------------------------------------------- the loss as one call
# A custom operator: one opaque call wherever torch.compile meets it (torch.compile(model) would):
# traced, its loop would be unrolled, with a [V, D] partial of dL/dW alive per chunk.

def chunked_loss(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype,
                 with_grads: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean loss, dL/dx, dL/dW as float32), the gradients empty unless with_grads. G is made over
    each chunk's logits: a chunk holds one [chunk, V] in dtype (+ a float32 copy for bf16)."""
    n = len(x)
    w = weight.to(dtype)
    total = torch.zeros((), device=x.device)
    grad_x = torch.empty_like(x) if with_grads else x.new_empty(0)
    grad_w = torch.zeros_like(weight, dtype=torch.float32) if with_grads else x.new_empty(0)
    for c in loss_chunks(n, len(w)):
        x_c = x[c].to(w.dtype)
        g = F.linear(x_c, w)  # z = x W^T, [chunk, V]
        # The softmax step, fused on a GPU (memory-bound there) for a chunk that repays compiling.
        # On a CPU exp is bound by arithmetic, and the fused form, which makes it twice, is slower.
        fused = g.is_cuda and g.numel() >= FUSE_MIN_FLOATS
        total += (FUSED_SOFTMAX if fused else softmax_gradient_)(g, targets[c], n)  # now G
        if with_grads:
            grad_x[c].copy_(g @ w)
            if g.dtype == grad_w.dtype:
                grad_w.addmm_(g.t(), x_c)  # float32: accumulate in place, no [V, D] temporary
            elif adds_bf16_products_into_float32(g.device):
                torch.addmm(grad_w, g.t(), x_c, out_dtype=torch.float32, out=grad_w)  # the same
            else:
                grad_w += g.t() @ x_c  # a bf16 [V, D] temporary, then added: 1.5x the traffic
        del g  # before the next chunk's logits exist
    return total / n, grad_x, grad_w

chunked_cross_entropy = torch.library.custom_op("leviathan::chunked_cross_entropy", chunked_loss,
                                                mutates_args=())

@chunked_cross_entropy.register_fake
def _(x, weight, targets, dtype, with_grads):  # shapes and dtypes only, for the compiler
    empty = x.new_empty(0)
    return (x.new_empty((), dtype=torch.float32), torch.empty_like(x) if with_grads else empty,
            torch.empty_like(weight, dtype=torch.float32) if with_grads else empty)

def save_gradients(ctx, inputs, output):
    ctx.weight_dtype = inputs[1].dtype
    ctx.save_for_backward(*output[1:])
    ctx.set_materialize_grads(False)  # else backward gets [V, D] zeros for the unused outputs

def scale_gradients(ctx, grad_loss, *_):
    """Backward of chunked_cross_entropy: the gradients forward computed, times dLoss."""
    grad_x, grad_w = ctx.saved_tensors
    return grad_x * grad_loss.to(grad_x.dtype), (grad_w * grad_loss).to(ctx.weight_dtype), None, None, None

chunked_cross_entropy.register_autograd(scale_gradients, setup_context=save_gradients)

def linear_cross_entropy(x, weight, targets, reduction="mean"):
    """cross_entropy_reference, chunk by chunk over positions: the mean by the custom op, whose
    gradients come with it; with reduction="none", [N], for evaluation under no_grad (autograd would
    keep every chunk's logits), cross_entropy_reference on each chunk."""
    device = x.device.type
    # the head's matmul dtype: autocast's when on (bf16 on a GPU), else the weight's; cast once
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    if reduction == "none":
        w = weight.to(dtype)
        return torch.cat([cross_entropy_reference(x[c].to(dtype), w, targets[c], reduction="none")
                          for c in loss_chunks(len(x), len(w))])
    with_grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return chunked_cross_entropy(x, weight, targets, dtype, with_grads)[0]

# -------------------------------------------------------------------------- what torch.compile sees

def compile_lev(lev, **options):
    """LEV.generate compiled for any number of ids (Model.compile calls it, then compiles blocks).
    What the compiler sees, and why:
    - LEV.forward stays out: torch.unique's output size changes every batch, the backbone's never.
    - separable_modes stays out: traced, its backward's rebuilt phi would be merged with the
      forward's and saved. Its kernels are compiled on their own (Fused), as only then does phi stay
      in registers, unless a call is too small (FUSE_MIN_FLOATS) to repay seconds of compiling.
    - The loss is one custom-op call; inside it, on a GPU, each chunk's softmax step is Fused.
    Split reductions off, as in Fused: a resumed run's first call (other ids) must not change how
    it sums."""
    if options.get("backend", "inductor") == "inductor":
        options.setdefault("options", {"split_reductions": False})
    lev.generate = torch.compile(lev.generate, dynamic=True, **options)
