"""Parameter blueprints: every weight name and shape of the three SD 1.x networks.

Given a config from engine.models.config, each function here returns the exact state-dict
keys that diffusers (UNet2DConditionModel, AutoencoderKL) and transformers (CLIPTextModel)
store in their safetensors files, in module order, with PyTorch's layouts: Linear weights are
(out, in), Conv2d weights (out, in, kh, kw). The loader checks files against these tables,
make_model writes them, single_file maps them to and from the original LDM names, and the
forward-pass code can rely on nothing else existing.

Conventions the forward pass must follow (all checked against diffusers 0.42.1):
- text encoder keys carry the "text_model." prefix, as every SD 1.x checkpoint on disk has
  them (transformers >= 5.6 saves them without it; the loader adds it back);
- attention q/k/v projections of the UNet transformers have no bias, their to_out.0 has one;
  the VAE mid-block attention has biases everywhere and one head of all channels;
- ff.net.0.proj is the GEGLU projection, (2 * 4 * dim, dim): the first half of its output is
  the value, the second half the gate: out = value * gelu(gate) (exact erf GELU).
"""

from __future__ import annotations

from engine.models.config import CLIPTextConfig, UNetConfig, VAEConfig

Shapes = dict[str, tuple[int, ...]]


def _linear(p: Shapes, name: str, n_in: int, n_out: int, bias: bool = True) -> None:
    p[f"{name}.weight"] = (n_out, n_in)
    if bias:
        p[f"{name}.bias"] = (n_out,)


def _conv(p: Shapes, name: str, n_in: int, n_out: int, k: int) -> None:
    p[f"{name}.weight"] = (n_out, n_in, k, k)
    p[f"{name}.bias"] = (n_out,)


def _norm(p: Shapes, name: str, channels: int) -> None:
    p[f"{name}.weight"] = (channels,)
    p[f"{name}.bias"] = (channels,)


# ---------------------------------------------------------------------------------------------


def clip_param_shapes(cfg: CLIPTextConfig) -> Shapes:
    """CLIPTextModel; position_ids is a buffer, not a parameter, and is not listed."""
    p: Shapes = {}
    d, ff = cfg.hidden_size, cfg.intermediate_size
    p["text_model.embeddings.token_embedding.weight"] = (cfg.vocab_size, d)
    p["text_model.embeddings.position_embedding.weight"] = (cfg.max_position_embeddings, d)
    for i in range(cfg.num_hidden_layers):
        layer = f"text_model.encoder.layers.{i}"
        for proj in ("k_proj", "v_proj", "q_proj", "out_proj"):
            _linear(p, f"{layer}.self_attn.{proj}", d, d)
        _norm(p, f"{layer}.layer_norm1", d)
        _linear(p, f"{layer}.mlp.fc1", d, ff)
        _linear(p, f"{layer}.mlp.fc2", ff, d)
        _norm(p, f"{layer}.layer_norm2", d)
    _norm(p, "text_model.final_layer_norm", d)
    return p


# ---------------------------------------------------------------------------------------------


def _unet_resnet(p: Shapes, name: str, n_in: int, n_out: int, temb: int) -> None:
    """ResnetBlock2D with time conditioning; a 1x1 shortcut conv only when channels change."""
    _norm(p, f"{name}.norm1", n_in)
    _conv(p, f"{name}.conv1", n_in, n_out, 3)
    _linear(p, f"{name}.time_emb_proj", temb, n_out)
    _norm(p, f"{name}.norm2", n_out)
    _conv(p, f"{name}.conv2", n_out, n_out, 3)
    if n_in != n_out:
        _conv(p, f"{name}.conv_shortcut", n_in, n_out, 1)


def _unet_transformer(
    p: Shapes, name: str, channels: int, depth: int, cross_dim: int, linear_proj: bool
) -> None:
    """Transformer2DModel: GroupNorm, proj_in, `depth` BasicTransformerBlocks, proj_out.

    The inner width equals `channels` (heads * head_dim), so every attention is square.
    """
    d = channels
    _norm(p, f"{name}.norm", channels)
    if linear_proj:
        _linear(p, f"{name}.proj_in", channels, d)
    else:
        _conv(p, f"{name}.proj_in", channels, d, 1)
    for k in range(depth):
        blk = f"{name}.transformer_blocks.{k}"
        _norm(p, f"{blk}.norm1", d)
        _linear(p, f"{blk}.attn1.to_q", d, d, bias=False)
        _linear(p, f"{blk}.attn1.to_k", d, d, bias=False)
        _linear(p, f"{blk}.attn1.to_v", d, d, bias=False)
        _linear(p, f"{blk}.attn1.to_out.0", d, d)
        _norm(p, f"{blk}.norm2", d)
        _linear(p, f"{blk}.attn2.to_q", d, d, bias=False)
        _linear(p, f"{blk}.attn2.to_k", cross_dim, d, bias=False)
        _linear(p, f"{blk}.attn2.to_v", cross_dim, d, bias=False)
        _linear(p, f"{blk}.attn2.to_out.0", d, d)
        _norm(p, f"{blk}.norm3", d)
        _linear(p, f"{blk}.ff.net.0.proj", d, 2 * 4 * d)  # GEGLU: value and gate halves
        _linear(p, f"{blk}.ff.net.2", 4 * d, d)
    if linear_proj:
        _linear(p, f"{name}.proj_out", d, channels)
    else:
        _conv(p, f"{name}.proj_out", d, channels, 1)


def unet_param_shapes(cfg: UNetConfig) -> Shapes:
    p: Shapes = {}
    ch = cfg.block_out_channels
    n = len(ch)
    temb = cfg.time_embed_dim
    cross = cfg.cross_attention_dim

    def transformer(name: str, c: int, block: int) -> None:
        _unet_transformer(
            p, name, c, cfg.transformer_layers_per_block[block], cross, cfg.use_linear_projection
        )

    _conv(p, "conv_in", cfg.in_channels, ch[0], 3)
    _linear(p, "time_embedding.linear_1", ch[0], temb)
    _linear(p, "time_embedding.linear_2", temb, temb)

    # Down path. Each resnet (and each downsampler) output is kept as a skip for the up path.
    c_out = ch[0]
    for i, kind in enumerate(cfg.down_block_types):
        c_in, c_out = c_out, ch[i]
        for j in range(cfg.layers_per_block[i]):
            _unet_resnet(p, f"down_blocks.{i}.resnets.{j}", c_in if j == 0 else c_out, c_out, temb)
            if kind == "CrossAttnDownBlock2D":
                transformer(f"down_blocks.{i}.attentions.{j}", c_out, i)
        if i < n - 1:
            _conv(p, f"down_blocks.{i}.downsamplers.0.conv", c_out, c_out, 3)

    # Mid: resnet, transformer, resnet at the lowest resolution.
    _unet_resnet(p, "mid_block.resnets.0", ch[-1], ch[-1], temb)
    transformer("mid_block.attentions.0", ch[-1], n - 1)
    _unet_resnet(p, "mid_block.resnets.1", ch[-1], ch[-1], temb)

    # Up path: block i works at channels ch[n-1-i] and concatenates one skip per resnet. The
    # last resnet of a block takes the skip that came from the previous (higher-resolution)
    # down block, hence its different channel count.
    c_out = ch[-1]
    for i, kind in enumerate(cfg.up_block_types):
        rev = n - 1 - i
        c_prev, c_out = c_out, ch[rev]
        c_skip_last = ch[max(rev - 1, 0)]
        n_layers = cfg.layers_per_block[rev] + 1
        for j in range(n_layers):
            c_skip = c_skip_last if j == n_layers - 1 else c_out
            c_res_in = c_prev if j == 0 else c_out
            _unet_resnet(p, f"up_blocks.{i}.resnets.{j}", c_res_in + c_skip, c_out, temb)
            if kind == "CrossAttnUpBlock2D":
                transformer(f"up_blocks.{i}.attentions.{j}", c_out, rev)
        if i < n - 1:
            _conv(p, f"up_blocks.{i}.upsamplers.0.conv", c_out, c_out, 3)

    _norm(p, "conv_norm_out", ch[0])
    _conv(p, "conv_out", ch[0], cfg.out_channels, 3)
    return p


# ---------------------------------------------------------------------------------------------


def _vae_resnet(p: Shapes, name: str, n_in: int, n_out: int) -> None:
    """ResnetBlock2D without time conditioning (temb_channels=None)."""
    _norm(p, f"{name}.norm1", n_in)
    _conv(p, f"{name}.conv1", n_in, n_out, 3)
    _norm(p, f"{name}.norm2", n_out)
    _conv(p, f"{name}.conv2", n_out, n_out, 3)
    if n_in != n_out:
        _conv(p, f"{name}.conv_shortcut", n_in, n_out, 1)


def _vae_mid(p: Shapes, name: str, c: int, attention: bool) -> None:
    _vae_resnet(p, f"{name}.resnets.0", c, c)
    if attention:
        att = f"{name}.attentions.0"
        _norm(p, f"{att}.group_norm", c)
        for proj in ("to_q", "to_k", "to_v", "to_out.0"):
            _linear(p, f"{att}.{proj}", c, c)
    _vae_resnet(p, f"{name}.resnets.1", c, c)


def vae_param_shapes(cfg: VAEConfig) -> Shapes:
    """AutoencoderKL: encoder, quant_conv, post_quant_conv, decoder (file order differs; the
    loader matches by name)."""
    p: Shapes = {}
    ch = cfg.block_out_channels
    n = len(ch)
    lat = cfg.latent_channels

    _conv(p, "encoder.conv_in", cfg.in_channels, ch[0], 3)
    c_out = ch[0]
    for i in range(n):
        c_in, c_out = c_out, ch[i]
        for j in range(cfg.layers_per_block):
            _vae_resnet(p, f"encoder.down_blocks.{i}.resnets.{j}", c_in if j == 0 else c_out, c_out)
        if i < n - 1:
            _conv(p, f"encoder.down_blocks.{i}.downsamplers.0.conv", c_out, c_out, 3)
    _vae_mid(p, "encoder.mid_block", ch[-1], cfg.mid_block_add_attention)
    _norm(p, "encoder.conv_norm_out", ch[-1])
    _conv(p, "encoder.conv_out", ch[-1], 2 * lat, 3)  # mean and logvar

    if cfg.use_quant_conv:
        _conv(p, "quant_conv", 2 * lat, 2 * lat, 1)
    if cfg.use_post_quant_conv:
        _conv(p, "post_quant_conv", lat, lat, 1)

    _conv(p, "decoder.conv_in", lat, ch[-1], 3)
    _vae_mid(p, "decoder.mid_block", ch[-1], cfg.mid_block_add_attention)
    c_out = ch[-1]
    for i in range(n):
        c_in, c_out = c_out, ch[n - 1 - i]
        for j in range(cfg.layers_per_block + 1):
            _vae_resnet(p, f"decoder.up_blocks.{i}.resnets.{j}", c_in if j == 0 else c_out, c_out)
        if i < n - 1:
            _conv(p, f"decoder.up_blocks.{i}.upsamplers.0.conv", c_out, c_out, 3)
    _norm(p, "decoder.conv_norm_out", ch[0])
    _conv(p, "decoder.conv_out", ch[0], cfg.out_channels, 3)
    return p


def param_shapes(component: str, cfg) -> Shapes:
    """The blueprint of one component by its diffusers folder name."""
    if component == "text_encoder":
        return clip_param_shapes(cfg)
    if component == "unet":
        return unet_param_shapes(cfg)
    if component == "vae":
        return vae_param_shapes(cfg)
    raise ValueError(f"unknown component {component!r}; expected text_encoder, unet or vae")
