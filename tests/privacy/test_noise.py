"""The secure noise sampler (``secure_noise``): a sum of draws that is still exactly N(0, std^2), used by every noise
of a run that asks for it, and a declared constant of the private optimizer and the pre-trainer."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import clipless as cl
from clipless.privacy import noise
from clipless.privacy.noise import SECURE_DRAWS, add_gaussian_noise_, gaussian, noisy_count


def test_a_secure_draw_is_the_scaled_sum_of_four_plain_draws_and_standard_normal():
    torch.manual_seed(0)
    plain = torch.Generator().manual_seed(7)
    draws = [noise._box_muller((5000,), plain, "cpu", torch.float64) for _ in range(SECURE_DRAWS)]
    secure = gaussian(5000, torch.Generator().manual_seed(7), dtype=torch.float64, secure=True)
    # within 1e-9, not bitwise: torch's CPU log is sometimes 1e-13 off in a process's first call (MKL, 2.13.0)
    assert SECURE_DRAWS == 4 and torch.allclose(secure, sum(draws) / 2, rtol=0, atol=1e-9)
    assert torch.allclose(gaussian(5000, torch.Generator().manual_seed(7), dtype=torch.float64), draws[0],
                          rtol=0, atol=1e-9)
    # the sum keeps the distribution: N(0, 1) by its moments and a Kolmogorov-Smirnov test
    big = gaussian(200_000, torch.Generator().manual_seed(1), dtype=torch.float64, secure=True)
    assert abs(float(big.mean())) < 0.01 and abs(float(big.std()) - 1) < 0.01
    ordered = big.sort().values
    cdf = 0.5 * (1 + torch.erf(ordered / math.sqrt(2)))
    empirical = torch.arange(1, ordered.numel() + 1, dtype=torch.float64) / ordered.numel()
    assert float((cdf - empirical).abs().max()) < 1.63 / math.sqrt(ordered.numel())  # KS at the 1% level
    # float32 draws too (the dtype of the weights), and a scalar (a count's noise)
    assert gaussian((3, 4), None, dtype=torch.float32, secure=True).dtype == torch.float32
    assert gaussian((), None, dtype=torch.float64, secure=True).shape == ()


def test_the_noise_tails_reach_past_torchs_float32_bound(monkeypatch):
    """Torch's float32 randn on the CPU takes its Box-Muller radius from a 24-bit uniform, so no draw exceeds
    sqrt(2 ln 2^24) = 5.77 (max over 1e9 draws: 5.759; a true Gaussian's is about 6.1): a noise coordinate beyond
    5.77 std from one neighbour's sum then proves the other, a chance per step of P(Z > 5.77 - shift / std) that no
    accountant counts. The radius now comes from an exponential redrawn past 20 ln 2 (memoryless), without a bound:
    the most extreme first uniform (39 bits) and two extreme redraws (53 bits) take it past 9."""
    real_bits, real_rand = noise.mechanism_words, torch.rand
    redraws = [2]

    def extreme_bits(*args, **kwargs):  # the generator's own draws, the first pair's radius bits all ones
        bits = real_bits(*args, **kwargs)
        bits[0] = ((2 ** 39 - 1) << 24) | (bits[0] & (2 ** 24 - 1))
        return bits

    def extreme_rand(*args, **kwargs):  # the first of the next two float64 draws at 1 - 2^-53
        out = real_rand(*args, **kwargs)
        if out.dtype == torch.float64 and redraws[0] > 0:
            out.view(-1)[0] = 1 - 2.0 ** -53
            redraws[0] -= 1
        return out

    monkeypatch.setattr(noise, "mechanism_words", extreme_bits)
    monkeypatch.setattr(noise.torch, "rand", extreme_rand)
    for dtype in (torch.float32, torch.float64):
        redraws[0] = 2
        z = gaussian(1000, torch.Generator().manual_seed(0), dtype=dtype)
        radius = math.hypot(float(z[0]), float(z[500]))  # the first radius, times the cosine and sine of its angle
        assert z.dtype == dtype and radius > math.sqrt(2 * 3 * 20 * math.log(2)) > 9.1
    monkeypatch.undo()
    # the redraw keeps the law: with the level at 1 (a third of the draws redrawn, some several times), Exp(1) still,
    # and so do the normals
    monkeypatch.setattr(noise, "_TAIL_LEVEL", 1.0)
    gen = torch.Generator().manual_seed(3)
    e = noise._redraw_tail_(noise._exponential_draws(1_000_000, gen, "cpu"), gen, "cpu")
    assert abs(float(e.mean()) - 1) < 0.005 and abs(float(e.var()) - 1) < 0.01
    for t in (1.0, 3.0, 6.0):
        assert abs(float((e > t).double().mean()) - math.exp(-t)) < 4 * math.sqrt(math.exp(-t) / e.numel())
    z = gaussian(1_000_000, torch.Generator().manual_seed(4), dtype=torch.float64)
    assert abs(float(z.mean())) < 0.005 and abs(float(z.var()) - 1) < 0.01
    monkeypatch.undo()
    # and the Gaussian tails keep their weight: counts beyond 4 and 4.5 in 2e7 draws, within 4 standard errors
    z = gaussian(20_000_000, torch.Generator().manual_seed(2)).abs()
    for t in (4.0, 4.5):
        expected = z.numel() * math.erfc(t / math.sqrt(2))
        assert abs(int((z > t).sum()) - expected) < 4 * math.sqrt(expected)


def test_noise_and_batches_of_a_secret_generator_come_from_its_aes_key_stream(monkeypatch):
    """The secret generators were MT19937 filled from OS entropy: secret, but not cryptographic. An adversary who
    knows every other record and sees every iterate reads the generator's outputs (less one record's gradient) in
    the noise, and MT19937's tempering is linear, so its state, and every later draw and batch, can be solved for;
    only secure mode took os.urandom bits. Every noise value and Poisson draw of a secret generator now comes from
    its AES-256-CTR key stream (key and first counter block from os.urandom), secure or not: the torch state is not
    advanced, the words are the AES-CTR key stream itself, the draws keep their laws, and a seeded generator (an
    experiment) keeps its reproducible torch draws."""
    import os

    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    from clipless.privacy import randomness
    from clipless.privacy.sampling import poisson_mask

    entropy = []
    real_urandom = os.urandom
    monkeypatch.setattr(randomness.os, "urandom", lambda n: entropy.append(real_urandom(n)) or entropy[-1])
    gen = randomness.secret_generator()
    monkeypatch.undo()
    key, counter = [b for b in entropy if len(b) in (32, 16)][:2]
    reference = Cipher(algorithms.AES(key), modes.CTR(counter)).encryptor()
    for n in (1000, 200_000):  # the second draw spans several of the stream's 1 MiB chunks and goes on from the first
        expected = torch.frombuffer(bytearray(reference.update(bytes(8 * n))), dtype=torch.int64) & (2**63 - 1)
        assert torch.equal(randomness.mechanism_words(gen, n, "cpu"), expected)

    drawn = []
    real_words = randomness._KeyStream.words
    monkeypatch.setattr(randomness._KeyStream, "words", lambda self, n: drawn.append(n) or real_words(self, n))
    state = gen.get_state().clone()
    for secure in (False, True):
        drawn.clear()
        z = gaussian(2_000_000, gen, dtype=torch.float64, secure=secure)
        assert sum(drawn) >= (4 if secure else 1) * 1_000_000
        assert abs(float(z.mean())) < 0.005 and abs(float(z.var()) - 1) < 0.01
        for t in (3.0, 4.0):
            expected_count = z.numel() * math.erfc(t / math.sqrt(2))
            assert abs(int((z.abs() > t).sum()) - expected_count) < 4 * math.sqrt(expected_count)
    e = noise._exponential_draws(1_000_000, gen, "cpu")
    assert abs(float(e.mean()) - 1) < 0.005 and abs(float(e.var()) - 1) < 0.01
    monkeypatch.setattr(noise, "_TAIL_LEVEL", 1.0)  # a third of the draws redrawn, from the key stream
    e = noise._redraw_tail_(noise._exponential_draws(1_000_000, gen, "cpu"), gen, "cpu")
    assert abs(float((e > 3.0).double().mean()) - math.exp(-3.0)) < 4 * math.sqrt(math.exp(-3.0) / e.numel())
    drawn.clear()
    mask = poisson_mask(1_000_000, 1 << 51, gen)  # q = 1/4
    assert drawn == [1_000_000] and abs(float(mask.double().mean()) - 0.25) < 4 * math.sqrt(0.25 * 0.75 / 1e6)
    assert torch.equal(gen.get_state(), state)  # the torch state never served the mechanism
    # copies and other secret generators have their own keys; a seeded generator keeps its torch draws
    import copy

    assert not torch.equal(randomness.mechanism_words(copy.deepcopy(gen), 8, "cpu"),
                           randomness.mechanism_words(gen, 8, "cpu"))
    drawn.clear()
    before = torch.Generator().manual_seed(5).get_state()
    seeded = [gaussian(100, torch.Generator().manual_seed(5), secure=s) for s in (True, True, False)]
    assert torch.allclose(seeded[0], seeded[1], rtol=0, atol=1e-6) and not drawn
    seeded_gen = torch.Generator().manual_seed(5)
    poisson_mask(10, 1 << 51, seeded_gen)
    assert not torch.equal(seeded_gen.get_state(), before)


def test_gaussian_without_a_generator_does_not_draw_from_torchs_global_one():
    """``gaussian(shape, None)`` drew from torch's global generator, as public as a ``torch.manual_seed`` call in the
    user's script: the same seed gave the same noise. It now draws from OS entropy, as the other noise primitives
    do without a generator (and secure mode from os.urandom)."""
    draws = []
    for secure in (False, False, True, True):
        torch.manual_seed(0)
        draws.append(gaussian(1000, None, secure=secure))
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[2], draws[3])
    torch.manual_seed(0)
    state = torch.get_rng_state()
    gaussian(1000, None)
    assert torch.equal(torch.get_rng_state(), state)  # the global generator is not advanced


def test_the_noise_primitives_draw_securely_on_request():
    def grad_noise(secure):
        p = nn.Parameter(torch.zeros(64))
        p.grad = torch.zeros(64)
        add_gaussian_noise_([p], 2.0, 4.0, torch.Generator().manual_seed(3), secure)
        return p.grad

    expected = 2.0 * gaussian(64, torch.Generator().manual_seed(3), secure=True) / 4.0
    assert torch.allclose(grad_noise(True), expected, rtol=1e-6, atol=0)
    assert not torch.equal(grad_noise(False), expected)
    count = noisy_count(3.0, 2.0, torch.Generator().manual_seed(5), secure=True)
    assert count == 3.0 + 2.0 * float(gaussian((), torch.Generator().manual_seed(5), dtype=torch.float64, secure=True))


def _private(secure_noise, model=None, **kwargs):
    torch.manual_seed(0)
    model = model or nn.Sequential(cl.InputNormClip(1.0), cl.LipschitzLinear(5, 3))
    data = cl.ArrayDataset(torch.randn(64, 5), torch.randint(0, 3, (64,)))
    return cl.PrivacyEngine("rdp").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=data, loss=cl.TauCrossEntropy(),
        noise_multiplier=1.0, input_shape=(5,), batch_size=16.0, secure_noise=secure_noise, **kwargs)


def test_a_secure_private_step_draws_four_times_and_stays_a_declared_constant(monkeypatch):
    calls = []
    draw = noise._box_muller

    def counted(*args, **kwargs):
        calls.append(args[0])
        return draw(*args, **kwargs)

    for secure, draws in ((False, 1), (True, SECURE_DRAWS)):
        # counted from before make_private: the step refuses the privacy core's functions replaced after it
        monkeypatch.setattr(noise, "_box_muller", counted)
        model, opt, loader = _private(secure)
        x, y = next(iter(loader))
        opt.zero_grad()
        cl.TauCrossEntropy().per_example(model(x), y).sum().backward()
        calls.clear()
        opt.step()
        assert len(calls) == draws  # one weight (no bias): its noise, drawn once or four times
        assert opt.secure_noise is secure
    with pytest.raises(AttributeError, match="secure_noise is a declared constant"):
        opt.secure_noise = False
    opt.__dict__["secure_noise"] = False  # past the read-only guard: the next step refuses
    opt.zero_grad()
    x, y = next(iter(loader))
    cl.TauCrossEntropy().per_example(model(x), y).sum().backward()
    with pytest.raises(cl.BoundError, match="settings"):
        opt.step()
    with pytest.raises(ValueError, match="secure_noise must be True or False"):
        _private("yes")


def test_secure_noise_reaches_the_adaptive_clips_count_and_refuses_a_mechanism_without_the_flag(monkeypatch):
    seen = []
    plain = noise.gaussian

    def recorded(shape, generator, device="cpu", dtype=torch.float32, secure=False):
        if shape == ():  # the count's one draw (the weights' noise has their shapes)
            seen.append(secure)
        return plain(shape, generator, device, dtype, secure)

    # noisy_count's sampler (replacing noisy_count itself in the namespace the clip reads is refused by make_private)
    monkeypatch.setattr(noise, "gaussian", recorded)
    clip = cl.AdaptiveLossGradientClip(1e6, count_noise_multiplier=1.0)
    model, opt, loader = _private(True, nn.Sequential(cl.InputNormClip(1.0), cl.LipschitzLinear(5, 3), clip))
    x, y = next(iter(loader))
    opt.zero_grad()
    cl.TauCrossEntropy().per_example(model(x), y).sum().backward()
    opt.step()
    assert seen == [True]

    class OldClip(cl.AdaptiveLossGradientClip):  # a mechanism written before the flag existed
        def update_(self, expected_batch_size, generator=None, distributed=False):
            return super().update_(expected_batch_size, generator, distributed)

    old = OldClip(1e6, count_noise_multiplier=1.0)
    with pytest.raises(ValueError, match="OldClip.update_ takes no 'secure' argument"):
        _private(True, nn.Sequential(cl.InputNormClip(1.0), cl.LipschitzLinear(5, 3), old))
    _private(False, nn.Sequential(cl.InputNormClip(1.0), cl.LipschitzLinear(5, 3), OldClip(1e6, 1.0)))


def test_the_trainer_the_pretrainer_and_the_cli_pass_secure_noise_on(tmp_path, monkeypatch):
    from clipless.cli import main
    from clipless.contrastive import ContrastivePretrainer, GivenPairs

    shape = (1, 4, 4)
    model = cl.lipschitz_mlp(shape, 3, hidden=(8,), input_clip=1.0)
    trainer = cl.PrivateTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cl.TauCrossEntropy(),
                                cl.ArrayDataset(torch.rand(64, *shape) / 4, torch.randint(0, 3, (64,))),
                                input_shape=shape, batch_size=8, delta=1e-3, epochs=1, noise_multiplier=1.0,
                                progress=False, log=None, secure_noise=True)
    assert trainer.optimizer.secure_noise is True
    secure = []
    plain_noise = noise.add_gaussian_noise_

    def recorded(params, std, b, generator, secure_flag=False):
        secure.append(secure_flag)
        return plain_noise(params, std, b, generator, secure_flag)

    monkeypatch.setattr("clipless.contrastive.pretrain.add_gaussian_noise_", recorded)
    xa = torch.rand(32, 8)
    encoder = nn.Sequential(nn.Linear(8, 4))
    ContrastivePretrainer(encoder, torch.optim.SGD(encoder.parameters(), lr=0.1), GivenPairs(xa, xa + 0.01),
                          batch_size=8, epochs=1, delta=1e-3, noise_multiplier=1.0, progress=False, log=None,
                          secure_noise=True).fit()
    assert secure and all(secure)
    out = tmp_path / "run"
    assert main(["train", "--epochs", "1", "--hidden", "8", "--batch-size", "256", "--accountant", "rdp",
                 "--no-progress", "--secure-noise", "--output-dir", str(out)]) == 0
    import json

    assert json.loads((out / "result.json").read_text())["config"]["secure_noise"] is True


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="os.fork is POSIX only")
def test_a_forked_process_draws_its_own_noise_and_batches():
    """Forks of one run (a search over os.fork, or multiprocessing's fork start) held copies of the secret
    generator's key stream, so each fork drew the parent's noise and batches: the difference of two forks' releases
    carried no noise. A forked process now takes a fresh key at its first draw; the parent's stream goes on."""
    import os

    from clipless.privacy.randomness import mechanism_words, secret_generator
    from clipless.privacy.sampling import poisson_mask

    gen = secret_generator()
    mechanism_words(gen, 4, "cpu")  # the parent has drawn before the fork
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its draws, written to the pipe
        try:
            import signal

            signal.alarm(30)  # a child stuck in a runtime that forking broke dies, and the parent reads nothing
            drawn = torch.cat([mechanism_words(gen, 64, "cpu"), poisson_mask(64, 1 << 52, gen).long()])
            os.write(write, drawn.numpy().tobytes())
        finally:
            os._exit(0)
    os.close(write)
    chunks = []
    while True:
        chunk = os.read(read, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    child = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.int64)
    parent = torch.cat([mechanism_words(gen, 64, "cpu"), poisson_mask(64, 1 << 52, gen).long()])
    assert child.numel() == parent.numel() == 128
    assert not torch.equal(child[:64], parent[:64]) and not torch.equal(child[64:], parent[64:])
