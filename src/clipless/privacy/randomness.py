"""Secret randomness for the private mechanism (spec §1, §7).

The guarantee assumes the adversary does not know the noise or which records a batch holds.  Every
generator that draws noise, Poisson batches or augmentations therefore comes from
:func:`secret_generator`, seeded from OS entropy, unless the user asks for a fixed seed, and a run with
a fixed seed is labelled as not private against anyone who knows it (:func:`randomness_label`).

The noise and the Poisson draws of a secret generator come from its key stream, AES-256 in counter mode under
a key from ``os.urandom`` (:func:`mechanism_words`): a cryptographic generator, whose outputs say nothing of its
other outputs.  Torch's generators are not: MT19937's outputs are linear in its state, so an adversary who knows
every other record and sees the iterates would read the noise (less one record's gradient) in them and solve for
the state and every later draw.  The torch state of a secret generator serves the rest (augmentations): on the CPU
its whole 624-word MT19937 state (19,968 bits) comes from ``os.urandom``, as torch's ``manual_seed`` keeps only 32
bits (2^32 seeds could be searched by retraining); on a GPU, Philox keys on all 64 bits of its seed.
"""

from __future__ import annotations

import hashlib
import os
import struct
from typing import Any, Dict, Optional, Union

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from .certified import is_whole

__all__ = ["secret_generator", "is_secret_generator", "make_generator", "mechanism_words", "randomness_label",
           "check_generator",
           "secret_seed", "resume_generator", "saved_generator_state"]

# Layout of the CPU generator state (ATen CPUGeneratorImplState): initial seed (u64), left (i32),
# seeded (i32), next (u64), then the 624 Mersenne Twister words stored as u64.
_MT_WORDS = 624
_MT_OFFSET = struct.calcsize("<QiiQ")


def secret_seed(bits: int = 64) -> int:
    """A fresh integer from OS entropy."""
    return int.from_bytes(os.urandom((bits + 7) // 8), "little") % (1 << bits)


_ZEROS = memoryview(bytes(1 << 20))


class _KeyStream:
    """AES-256 in counter mode, key and first counter block from ``os.urandom``: a cryptographic pseudo-random
    stream (about 6 GB/s with AES instructions, faster than MT19937 through torch).  A forked process takes a fresh
    key at its first draw: forks of one run (a search over ``os.fork`` or a fork-started ``multiprocessing``) would
    otherwise draw the same noise and batches, and the difference of their releases would carry no noise."""

    def __init__(self) -> None:
        self._rekey()

    def _rekey(self) -> None:
        self._pid = os.getpid()
        self._encryptor = Cipher(algorithms.AES(os.urandom(32)), modes.CTR(os.urandom(16))).encryptor()

    def words(self, n: int) -> torch.Tensor:
        """``n`` integers uniform on ``[0, 2^63)``: 8 bytes of key stream each, the top bit cleared."""
        if os.getpid() != self._pid:
            self._rekey()
        out = torch.empty(n + 2, dtype=torch.int64)  # 16 bytes of slack: older update_into asks for a block's
        view = memoryview(out.numpy()).cast("B")
        done, total = 0, 8 * n
        while done < total:  # encrypting zeros gives the key stream; one shared buffer of zeros, no new one a call
            size = min(len(_ZEROS), total - done)
            if self._encryptor.update_into(_ZEROS[:size], view[done:]) != size:
                raise RuntimeError("the AES key stream returned fewer bytes than asked")
            done += size
        return out[:n].bitwise_and_(2**63 - 1)


class _SecretGenerator(torch.Generator):
    """A generator that is never duplicated: a deep copy or an unpickled copy is a fresh secret generator.

    Copies of a run (``copy.deepcopy`` of a model and its private optimizer for a hyperparameter search, say)
    would otherwise draw the same noise and batches, and the difference of two copies' releases would carry no
    noise.  Checkpoints do not keep its state (:func:`saved_generator_state`)."""

    _sealed = False  # set once secret_generator has seeded it from OS entropy

    def _check_unsealed(self, what: str) -> None:
        if self._sealed:
            raise RuntimeError(f"{what} on a secret generator: its state must stay unknown, and the run would go on "
                               "calling its noise or batches OS entropy; for a reproducible, non-private run pass a "
                               "fixed noise_seed (noise_generator=) when the run is built")

    def manual_seed(self, seed: int) -> torch.Generator:
        self._check_unsealed("manual_seed")
        return super().manual_seed(seed)

    def set_state(self, new_state: torch.Tensor) -> torch.Generator:
        self._check_unsealed("set_state")
        return super().set_state(new_state)

    def seed(self) -> int:
        self._check_unsealed("seed")
        return super().seed()

    def __deepcopy__(self, memo: Dict[int, Any]) -> "_SecretGenerator":
        return secret_generator(self.device)

    def __reduce__(self) -> Any:
        return secret_generator, (str(self.device),)


def is_secret_generator(generator: Any) -> bool:
    """Whether ``generator`` is one of :func:`secret_generator`'s (from OS entropy, never seeded by hand)."""
    return isinstance(generator, _SecretGenerator) and generator._sealed


def secret_generator(device: Union[str, torch.device] = "cpu") -> torch.Generator:
    """A generator from OS entropy: its noise and Poisson draws from an AES key stream (:func:`mechanism_words`), its
    torch state (>= 64 bits; 19,968 bits on CPU) for the rest; copies of it are fresh secret generators, never
    replicas."""
    device = torch.device(device)
    generator = _SecretGenerator(device=device)
    generator._stream = _KeyStream()
    if device.type != "cpu":
        generator.manual_seed(secret_seed(64))
        generator._sealed = True
        return generator
    generator.manual_seed(secret_seed(32))  # puts the header in the freshly-seeded form (left = 1)
    state = generator.get_state().clone()
    header = struct.unpack("<QiiQ", bytes(state[:_MT_OFFSET].tolist()))
    if state.numel() < _MT_OFFSET + 8 * _MT_WORDS or header[1:3] != (1, 1):
        raise RuntimeError("unexpected torch CPU generator state layout: cannot seed it from OS entropy")
    words = torch.frombuffer(bytearray(os.urandom(4 * _MT_WORDS)), dtype=torch.int32).to(torch.int64) & 0xFFFFFFFF
    state[_MT_OFFSET : _MT_OFFSET + 8 * _MT_WORDS] = words.view(torch.uint8)  # little-endian u64 words
    generator.set_state(state)
    if not torch.equal(generator.get_state()[_MT_OFFSET : _MT_OFFSET + 8 * _MT_WORDS],
                       state[_MT_OFFSET : _MT_OFFSET + 8 * _MT_WORDS]):
        raise RuntimeError("torch did not accept the entropy-filled generator state")
    generator._sealed = True
    return generator


def check_generator(generator: Any, name: str) -> Optional[torch.Generator]:
    """``generator`` as given, refused unless ``None`` (OS entropy: the private default) or a ``torch.Generator``;
    anything else failed later inside torch, at the first draw, naming no setting."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"{name} must be a torch.Generator, or None for OS entropy (the private default), got "
                        f"{type(generator).__name__} {generator!r}")
    return generator


def mechanism_words(generator: torch.Generator, n: int, device: Any) -> torch.Tensor:
    """``n`` integers uniform on ``[0, 2^63)`` for the mechanism's noise and Poisson draws: from a secret generator's
    AES key stream (its torch state is left alone), from a seeded generator's own stream (an experiment)."""
    if is_secret_generator(generator):
        return generator._stream.words(n).to(device)  # type: ignore[attr-defined]
    return torch.empty(n, dtype=torch.int64, device=device).random_(generator=generator)


def saved_generator_state(generator: torch.Generator) -> Optional[torch.Tensor]:
    """What a checkpoint keeps of a generator: a seeded stream's state, to continue it; nothing of a secret one.
    A private resume draws fresh OS entropy anyway, and the torch state would let whoever reads the checkpoint
    regenerate the augmentations already drawn (MT19937's state can be run backwards); the AES key is never saved."""
    return None if isinstance(generator, _SecretGenerator) else generator.get_state()


def resume_generator(generator: torch.Generator, state: Optional[torch.Tensor]) -> None:
    """Continue a saved stream on resume, unless ``generator`` is secret: a secret stream only has to be
    unknown, and two runs resumed from one saved state would otherwise draw the same noise and batches (the
    difference of their releases would carry no noise).  A seeded stream continues, for reproducibility."""
    if isinstance(generator, _SecretGenerator):
        return
    if state is None:
        raise ValueError("the saved state holds no generator state (its run drew noise and batches from OS "
                         "entropy): a fixed seed cannot continue it; resume without a fixed seed")
    generator.set_state(state)


def make_generator(seed: Optional[int], device: Union[str, torch.device] = "cpu", stream: int = 0) -> torch.Generator:
    """``secret_generator`` when ``seed`` is None, else a reproducible generator for stream ``stream`` of
    ``seed`` (experiments only: NOT private against anyone who knows ``seed``)."""
    if seed is None:
        return secret_generator(device)
    if not is_whole(seed):
        raise TypeError(f"a fixed noise seed must be an integer, got {seed!r}")
    # distinct streams of one seed (noise, sampling, augmentation) must not coincide
    digest = hashlib.sha256(f"clipless:{seed}:{stream}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little"))


def randomness_label(noise_seed: Optional[int]) -> Dict[str, Any]:
    """Fields every result file carries about the mechanism's randomness (spec §7)."""
    if noise_seed is None:
        return {"private": True, "randomness": "os-entropy",
                "privacy_note": "noise and Poisson sampling drawn from OS entropy; the guarantee holds"}
    return {"private": False, "randomness": "fixed-seed",
            "privacy_note": "noise and sampling come from a fixed seed: NOT private against anyone who knows "
                            "or guesses the seed (experiments only)"}
