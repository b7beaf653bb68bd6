"""Tests of diloco.outer against independent float64 NumPy oracles and optax."""

import itertools

import ml_dtypes
import numpy as np
import optax
import pytest

from diloco import outer
from diloco.outer import kernels, merge

# ---- Oracles: plain float64 NumPy, written from docs/design.md 2.4, not from the module. ----

def oracle_weights(tokens, steps, scheme):
  t, s = np.asarray(tokens, np.float64), np.asarray(steps, np.float64)
  raw = {"tokens2_per_step": np.divide(t * t, s, out=np.zeros_like(t), where=s > 0),
         "tokens": np.where(s > 0, t, 0.0), "uniform": (s > 0).astype(np.float64)}[scheme]
  return raw / raw.sum()


def oracle_mean(deltas, w):
  w = np.asarray(w, np.float64) / np.sum(w)
  return sum(wi * np.asarray(d, np.float64) for wi, d in zip(w, deltas))


def oracle_rda(deltas, w):
  w = np.asarray(w, np.float64) / np.sum(w)
  ds = [np.asarray(d, np.float64) for d in deltas]
  norms = [np.sqrt(np.sum(d * d)) for d in ds]
  units = [d / n if n > 0 else np.zeros_like(d) for d, n in zip(ds, norms)]
  direction = sum(wi * u for wi, u in zip(w, units))
  return sum(wi * n for wi, n in zip(w, norms)) * direction / np.sqrt(np.sum(direction ** 2))


def _deltas(rng, m, shape=(7, 13), dtype=np.float32):
  return [rng.standard_normal(shape).astype(dtype) for _ in range(m)]


@pytest.fixture
def small_chunks(monkeypatch):
  """Tiny chunks and blocks on two threads, so that multi-chunk, multi-block and tail paths run."""
  monkeypatch.setattr(kernels, "CHUNK", 16)
  monkeypatch.setattr(kernels, "BLOCK_CHUNKS", 2)
  monkeypatch.setattr(kernels, "MERGE_THREADS", 2)


# ---- Weights. ----

@pytest.mark.parametrize("scheme", outer.WEIGHT_SCHEMES)
def test_token_weights_match_oracle(scheme):
  tokens, steps = [1000, 3000, 0, 500, 700], [10, 24, 0, 5, 0]
  w = outer.token_weights(tokens, steps, scheme)
  assert w.dtype == np.float64
  np.testing.assert_allclose(w, oracle_weights(tokens, steps, scheme), rtol=1e-15)
  assert w[2] == 0 and w[4] == 0  # steps == 0 -> weight 0
  assert np.isclose(w.sum(), 1.0)


def test_token_weights_tokens2_per_step_value():
  w = outer.token_weights([100, 200], [1, 2])  # 10000 and 20000
  np.testing.assert_allclose(w, [1 / 3, 2 / 3])


@pytest.mark.parametrize("tokens,steps", [([0, 0], [0, 0]), ([5, 5], [0, 0]), ([0], [3])])
def test_token_weights_all_zero_raises(tokens, steps):
  with pytest.raises(ValueError, match="zero"):
    outer.token_weights(tokens, steps)


def test_token_weights_bad_inputs():
  with pytest.raises(ValueError, match="tokens2_per_step"):
    outer.token_weights([1], [1], "squared")
  with pytest.raises(ValueError, match="negative"):
    outer.token_weights([-1, 2], [1, 1])
  with pytest.raises(ValueError, match="length"):
    outer.token_weights([1, 2], [1])


# ---- Merges. ----

@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_weighted_mean_matches_oracle(m, small_chunks):
  rng = np.random.default_rng(m)
  ds, w = _deltas(rng, m), rng.uniform(0.1, 2.0, m)
  got = outer.weighted_mean(ds, w)
  assert got.dtype == np.float32 and got.shape == (7, 13)
  np.testing.assert_allclose(got, oracle_mean(ds, w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_rda_matches_oracle(m, small_chunks):
  rng = np.random.default_rng(10 + m)
  ds, w = _deltas(rng, m), rng.uniform(0.1, 2.0, m)
  got = outer.radial_directional_average(ds, w)
  assert got.dtype == np.float32 and got.shape == (7, 13)
  np.testing.assert_allclose(got, oracle_rda(ds, w), rtol=1e-5, atol=1e-6)


# Every method of the merge-method table and its NumPy oracle: a method added to the table
# without one fails here.
ORACLES = {"rda": oracle_rda, "mean": oracle_mean}


@pytest.mark.parametrize("name", sorted(merge.METHODS))
def test_every_merge_method_matches_its_oracle_in_both_forms(name, small_chunks):
  """The table's reference form against the NumPy oracle, and its streamed form (what the
  fused round consumes) against the reference, bit for bit, embedding rows included."""
  assert name in ORACLES, f"give merge method {name!r} a NumPy oracle in ORACLES"
  rule = merge.method_for(name, is_embedding=False)
  for m in (1, 3, 8):
    rng = np.random.default_rng(40 + m)
    ds, w = _deltas(rng, m), rng.uniform(0.1, 2.0, m)
    flats = [d.reshape(-1) for d in ds]
    wn = merge.check_weights(w, m)
    ref = rule.reference(flats, wn)
    np.testing.assert_allclose(ref.reshape(7, 13), ORACLES[name](ds, w), rtol=1e-5, atol=1e-6)
    workspace = np.empty(ref.size, np.float32) if rule.workspace else None
    stream = rule.stream(flats, wn, np.dtype(np.float32), workspace)
    got = np.empty(ref.size, np.float32)
    stream.chunk(0, got, stream.scratch(ref.size))
    np.testing.assert_array_equal(got, ref)
  assert merge.method_for(name, is_embedding=True).name == "mean"


def test_rda_float64_is_accurate():
  rng = np.random.default_rng(1)
  ds = _deltas(rng, 4, (1000,), np.float64)
  got = outer.radial_directional_average(ds, [1, 2, 3, 4])
  assert got.dtype == np.float64
  np.testing.assert_allclose(got, oracle_rda(ds, [1, 2, 3, 4]), rtol=1e-12, atol=1e-14)


def test_rda_bfloat16_accumulates_in_float32():
  rng = np.random.default_rng(2)
  ds = [d.astype(ml_dtypes.bfloat16) for d in _deltas(rng, 8, (300,))]
  got = outer.radial_directional_average(ds, np.ones(8))
  assert got.dtype == ml_dtypes.bfloat16
  want = oracle_rda([d.astype(np.float64) for d in ds], np.ones(8))
  np.testing.assert_allclose(got.astype(np.float64), want, rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("m", [2, 4, 16])
def test_rda_equal_norms_keep_the_norm(m):
  rng = np.random.default_rng(m)
  ds = [d / np.linalg.norm(d) * 3.0 for d in _deltas(rng, m, (64,), np.float64)]
  got = outer.radial_directional_average(ds, rng.uniform(0.5, 1.5, m))
  assert np.isclose(np.linalg.norm(got), 3.0, rtol=1e-12)
  # The weighted mean of nearly orthogonal deltas shrinks, which RDA is there to undo.
  assert np.linalg.norm(outer.weighted_mean(ds, np.ones(m))) < 3.0 * 0.9


def test_rda_permutation_invariant():
  rng = np.random.default_rng(3)
  ds, w = _deltas(rng, 5, (50,), np.float64), rng.uniform(0.1, 1, 5)
  ref = outer.radial_directional_average(ds, w)
  for perm in itertools.islice(itertools.permutations(range(5)), 1, 20, 3):
    got = outer.radial_directional_average([ds[i] for i in perm], w[list(perm)])
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-14)


def test_rda_single_input_returns_itself():
  d = np.random.default_rng(4).standard_normal((5, 6)).astype(np.float32)
  np.testing.assert_allclose(outer.radial_directional_average([d], [0.3]), d, rtol=1e-6)


def test_rda_weights_scale_invariant():
  rng = np.random.default_rng(5)
  ds, w = _deltas(rng, 4, (40,), np.float64), rng.uniform(0.1, 1, 4)
  np.testing.assert_allclose(outer.radial_directional_average(ds, w * 1234.5),
                             outer.radial_directional_average(ds, w), rtol=1e-12)


def test_rda_zero_vectors_have_no_direction():
  rng = np.random.default_rng(6)
  d = rng.standard_normal(30)
  zero = np.zeros(30)
  got = outer.radial_directional_average([d, zero], [0.5, 0.5])
  # Radius 0.5 * |d| + 0.5 * 0; direction unit(0.5 * unit(d)) = unit(d).
  np.testing.assert_allclose(got, 0.5 * d, rtol=1e-12)
  np.testing.assert_array_equal(outer.radial_directional_average([zero, zero], [1, 2]), zero)


def test_rda_vanishing_direction_falls_back_to_weighted_mean():
  d = np.linspace(-1.0, 2.0, 40)
  ds, w = [d, -2.0 * d], [0.5, 0.5]  # unit vectors cancel exactly
  got = outer.radial_directional_average(ds, w)
  np.testing.assert_allclose(got, -0.5 * d, rtol=1e-12)
  assert np.all(np.isfinite(got))


def test_rda_ignores_zero_weight_learners():
  rng = np.random.default_rng(7)
  ds = _deltas(rng, 3, (20,), np.float64)
  ds_nan = ds[:2] + [np.full(20, 1e30)]
  np.testing.assert_allclose(outer.radial_directional_average(ds_nan, [1, 1, 0]),
                             oracle_rda(ds[:2], [1, 1]), rtol=1e-12)


def test_merge_rejects_bad_inputs():
  a = np.zeros(3, np.float32)
  with pytest.raises(ValueError, match="delta 1"):
    outer.weighted_mean([a, np.zeros(4, np.float32)], [1, 1])
  with pytest.raises(ValueError, match="weights"):
    outer.radial_directional_average([a, a], [1])
  with pytest.raises(ValueError, match="non-negative"):
    outer.radial_directional_average([a, a], [1, -1])
  with pytest.raises(ValueError, match="floating"):
    outer.weighted_mean([np.zeros(3, np.int32)], [1])


def test_merge_fragment_dict_uses_mean_for_embedding(small_chunks):
  rng = np.random.default_rng(8)
  m = 4
  deltas = [{"emb": rng.standard_normal((9, 4)).astype(np.float32),
             "w": rng.standard_normal((5, 3)).astype(np.float32)} for _ in range(m)]
  w = outer.token_weights([100, 200, 300, 50], [5, 5, 7, 2])
  got = outer.merge_fragment(deltas, w, {"emb": True})
  assert set(got) == {"emb", "w"}
  np.testing.assert_allclose(got["emb"], oracle_mean([d["emb"] for d in deltas], w), rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(got["w"], oracle_rda([d["w"] for d in deltas], w), rtol=1e-5,
                             atol=1e-6)
  mean = outer.merge_fragment(deltas, w, {"emb": True}, method="mean")
  np.testing.assert_allclose(mean["w"], oracle_mean([d["w"] for d in deltas], w), rtol=1e-5,
                             atol=1e-6)
  assert not np.allclose(mean["w"], got["w"])


def test_merge_fragment_sequence_and_errors():
  rng = np.random.default_rng(9)
  deltas = [[rng.standard_normal(6), rng.standard_normal(4)] for _ in range(3)]
  got = outer.merge_fragment(deltas, [1, 1, 1], [False, True])
  assert isinstance(got, list) and len(got) == 2
  np.testing.assert_allclose(got[0], oracle_rda([d[0] for d in deltas], [1, 1, 1]), rtol=1e-12)
  np.testing.assert_allclose(got[1], oracle_mean([d[1] for d in deltas], [1, 1, 1]), rtol=1e-12)
  with pytest.raises(ValueError, match="rda"):
    outer.merge_fragment(deltas, [1, 1, 1], None, method="median")
  with pytest.raises(ValueError, match="entries"):
    outer.merge_fragment(deltas, [1, 1, 1], [True])
  with pytest.raises(ValueError, match="unknown tensors"):
    outer.merge_fragment([{"a": np.ones(2)}], [1], {"b": True})
  with pytest.raises(ValueError, match="other tensors"):
    outer.merge_fragment([{"a": np.ones(2)}, {"b": np.ones(2)}], [1, 1], None)


# ---- Outer gradient and anchors. ----

def test_outer_gradient_sign_and_rebase():
  rng = np.random.default_rng(10)
  g_base, g_now, theta = (rng.standard_normal(8) for _ in range(3))
  delta = outer.outer_gradient(g_base, theta)
  np.testing.assert_allclose(delta, g_base - theta)
  np.testing.assert_allclose(outer.rebase_delta(delta, g_base, g_now), g_now - theta,
                             rtol=1e-12, atol=1e-12)
  tree = outer.outer_gradient({"a": {"b": g_now}}, {"a": {"b": theta}})
  np.testing.assert_allclose(tree["a"]["b"], g_now - theta)
  with pytest.raises(ValueError, match="structure"):
    outer.outer_gradient({"a": g_now}, {"b": theta})


# ---- Nesterov against optax. ----

@pytest.mark.parametrize("inplace", [False, True])
def test_nesterov_matches_optax_over_steps(inplace, small_chunks):
  rng = np.random.default_rng(11)
  lr, mu = 0.7, 0.9
  params = {"a": rng.standard_normal((6, 7)).astype(np.float32),
            "b": {"c": rng.standard_normal(40).astype(np.float32)}}
  grads = [{"a": rng.standard_normal((6, 7)).astype(np.float32),
            "b": {"c": rng.standard_normal(40).astype(np.float32)}} for _ in range(5)]
  tx = optax.sgd(lr, momentum=mu, nesterov=True)
  ref_params, state = params, tx.init(params)
  p = {"a": params["a"].copy(), "b": {"c": params["b"]["c"].copy()}}
  b = None
  for g in grads:
    updates, state = tx.update(g, state, ref_params)
    ref_params = optax.apply_updates(ref_params, updates)
    p_before = p
    p, b = outer.nesterov_step(p, b, g, lr, mu, inplace=inplace)
    assert (p["a"] is p_before["a"]) == inplace  # leaves updated in place only on request
  np.testing.assert_allclose(p["a"], np.asarray(ref_params["a"]), rtol=2e-6, atol=2e-6)
  np.testing.assert_allclose(p["b"]["c"], np.asarray(ref_params["b"]["c"]), rtol=2e-6, atol=2e-6)
  np.testing.assert_allclose(b["a"], np.asarray(state[0].trace["a"]), rtol=2e-6, atol=2e-6)


def test_nesterov_formula_on_arrays_and_purity():
  p0, b0, g = np.array([1.0, 2.0]), np.array([0.5, -1.0]), np.array([0.2, 0.4])
  p, b = outer.nesterov_step(p0, b0, g, lr=0.5, mu=0.9)
  np.testing.assert_allclose(b, 0.9 * b0 + g)
  np.testing.assert_allclose(p, p0 - 0.5 * (g + 0.9 * (0.9 * b0 + g)))
  np.testing.assert_array_equal(p0, [1.0, 2.0])  # not in place by default
  np.testing.assert_array_equal(b0, [0.5, -1.0])
  p2, b2 = outer.nesterov_step(p0, b0, g, lr=0.5, mu=0.9, inplace=True)
  assert p2 is p0 and b2 is b0
  np.testing.assert_array_equal(p2, p)


# ---- Fused merge and Nesterov step (the syncer's round). ----

def oracle_nesterov(p, b, g, lr, mu):
  b = mu * b + g
  return p - lr * (g + mu * b), b


_SHAPES = {"emb": (9, 4), "w": (5, 7), "v": (37,), "s": ()}  # "emb" gets the weighted mean


def _fragment_deltas(rng, m, dtype=np.float32):
  return [{k: rng.standard_normal(s).astype(dtype) for k, s in _SHAPES.items()} for _ in range(m)]


def _copy(tree):
  if isinstance(tree, dict):
    return {k: np.array(v) for k, v in tree.items()}
  return [np.array(v) for v in tree]


@pytest.mark.parametrize("m", [1, 3, 8])
def test_merge_and_step_matches_oracle_and_optax(m, small_chunks):
  rng = np.random.default_rng(20 + m)
  lr, mu = 0.7, 0.9
  params = {k: rng.standard_normal(s).astype(np.float32) for k, s in _SHAPES.items()}
  momentum = {k: np.zeros(s, np.float32) for k, s in _SHAPES.items()}
  p64 = {k: v.astype(np.float64) for k, v in params.items()}
  b64 = {k: v.astype(np.float64) for k, v in momentum.items()}
  tx = optax.sgd(lr, momentum=mu, nesterov=True)
  ref_params, state = _copy(params), tx.init(_copy(params))
  workspace = np.empty(64, np.float32)
  for _ in range(3):
    deltas = _fragment_deltas(rng, m)
    w = rng.uniform(0.1, 2.0, m)
    before = _copy(params)
    step_sq = outer.merge_and_step(params, momentum, deltas, w, {"emb": True}, lr, mu,
                                   workspace=workspace)
    grads = {k: (oracle_mean if k == "emb" else oracle_rda)([d[k] for d in deltas], w)
             for k in _SHAPES}
    for k in _SHAPES:
      p64[k], b64[k] = oracle_nesterov(p64[k], b64[k], grads[k], lr, mu)
    updates, state = tx.update({k: g.astype(np.float32) for k, g in grads.items()}, state,
                               ref_params)
    ref_params = optax.apply_updates(ref_params, updates)
    assert set(step_sq) == set(_SHAPES)
    for k in _SHAPES:
      moved = np.sum((before[k].astype(np.float64) - params[k]) ** 2)
      np.testing.assert_allclose(step_sq[k], moved, rtol=1e-5)
  for k, shape in _SHAPES.items():
    assert params[k].dtype == np.float32 and params[k].shape == shape
    np.testing.assert_allclose(params[k], p64[k], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(momentum[k], b64[k], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(params[k], np.asarray(ref_params[k]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(momentum[k], np.asarray(state[0].trace[k]), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("method", outer.MERGE_METHODS)
@pytest.mark.parametrize("as_list", [False, True])
@pytest.mark.parametrize("with_workspace", [False, True])
def test_merge_and_step_rounds_like_merge_then_step(dtype, method, as_list, with_workspace,
                                                    small_chunks):
  rng = np.random.default_rng(30)
  deltas = _fragment_deltas(rng, 5, dtype)
  mask = {"emb": True}
  params = {k: rng.standard_normal(s).astype(np.float32) for k, s in _SHAPES.items()}
  momentum = {k: rng.standard_normal(s).astype(np.float32) for k, s in _SHAPES.items()}
  if as_list:
    deltas = [list(d.values()) for d in deltas]
    mask = [k == "emb" for k in _SHAPES]
    params, momentum = list(params.values()), list(momentum.values())
  w = outer.token_weights([900, 1200, 1500, 700, 1000], [9, 12, 14, 7, 11])
  keys = range(len(_SHAPES)) if as_list else _SHAPES
  p_ref, b_ref = _copy(params), _copy(momentum)
  grad = outer.merge_fragment(deltas, w, mask, method=method)
  for k in keys:
    outer.nesterov_step(p_ref[k], b_ref[k], grad[k], 0.5, 0.8, inplace=True)
  workspace = np.empty(40, dtype) if with_workspace else None
  step_sq = outer.merge_and_step(params, momentum, deltas, w, mask, 0.5, 0.8, method=method,
                                 workspace=workspace)
  assert isinstance(step_sq, list) == as_list
  for k in keys:
    np.testing.assert_array_equal(params[k], p_ref[k])
    np.testing.assert_array_equal(momentum[k], b_ref[k])


def _fused_one_tensor(deltas, w, grad, embedding=False, lr=0.5, mu=0.9):
  """`merge_and_step` on one tensor, and the float64 oracle step with gradient `grad`."""
  rng = np.random.default_rng(40)
  dtype = np.float64 if deltas[0].dtype == np.float64 else np.float32
  p = rng.standard_normal(deltas[0].shape).astype(dtype)
  b = rng.standard_normal(deltas[0].shape).astype(dtype)
  want = oracle_nesterov(p.astype(np.float64), b.astype(np.float64), grad, lr, mu)
  outer.merge_and_step([p], [b], [[d] for d in deltas], w, [embedding], lr, mu)
  return (p, b), want


def test_merge_and_step_edge_cases(small_chunks):
  rng = np.random.default_rng(41)
  d, e = rng.standard_normal(50), rng.standard_normal(50)
  zero = np.zeros(50)
  cases = [
      ([d, -2.0 * d], [0.5, 0.5], -0.5 * d),  # unit vectors cancel: weighted mean
      ([zero, zero], [1, 2], zero),  # nothing to merge: a momentum-only step
      ([d, e, np.full(50, 1e30)], [1, 1, 0], oracle_rda([d, e], [1, 1])),  # weight 0 ignored
      ([d * 1e150, e * 1e-150], [1, 3], oracle_rda([d * 1e150, e * 1e-150], [1, 3])),
  ]
  for deltas, w, grad in cases:
    got, want = _fused_one_tensor(deltas, w, grad)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-12, atol=1e-14)


def test_weighted_sums_with_extreme_coefficient_ratios(small_chunks):
  """Coefficients 1e32 apart (float32) are summed directly, not in Horner form."""
  rng = np.random.default_rng(42)
  d, e = (rng.standard_normal(40).astype(np.float32) for _ in range(2))
  f32 = np.dtype(np.float32)
  assert kernels.WeightedSum([d, e], [1.0, 1e-32], f32).direct
  assert not kernels.WeightedSum([d, e], [1.0, 1e-20], f32).direct
  big, small = d * np.float32(1e16), e * np.float32(1e-16)
  np.testing.assert_allclose(outer.radial_directional_average([big, small], [1, 2]),
                             oracle_rda([big, small], [1, 2]), rtol=1e-5, atol=1e-6)
  got, want = _fused_one_tensor([big, small], [1, 2], oracle_rda([big, small], [1, 2]))
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
  w = [1.0, 1e-35]
  np.testing.assert_allclose(outer.weighted_mean([d, e], w), oracle_mean([d, e], w), rtol=1e-6)
  got, want = _fused_one_tensor([d, e], w, oracle_mean([d, e], w), embedding=True)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)


def test_merge_and_step_keeps_bfloat16_merges_in_float32():
  rng = np.random.default_rng(43)
  ds = [d.astype(ml_dtypes.bfloat16) for d in _deltas(rng, 6, (300,))]
  grad = oracle_rda([d.astype(np.float64) for d in ds], np.ones(6))
  got, want = _fused_one_tensor(ds, np.ones(6), grad)
  assert got[0].dtype == np.float32
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)


def test_merge_and_step_rejects_bad_state_and_updates_nothing():
  rng = np.random.default_rng(44)
  deltas = _fragment_deltas(rng, 2)
  w = [1, 1]

  def state():
    return ({k: np.ones(s, np.float32) for k, s in _SHAPES.items()},
            {k: np.zeros(s, np.float32) for k, s in _SHAPES.items()})

  params, momentum = state()
  params["w"] = np.ones((7, 5), np.float32).T  # right shape, not C-contiguous
  bad = [(params, momentum, {}, "C-contiguous")]
  params, momentum = state()
  momentum["v"].flags.writeable = False
  bad.append((params, momentum, {}, "writeable"))
  params, momentum = state()
  params["v"] = np.ones(36, np.float32)
  bad.append((params, momentum, {}, "shape"))
  params, momentum = state()
  del momentum["s"]
  bad.append((params, momentum, {}, "lacks"))
  for kwargs in ({"workspace": np.empty(64, np.float64)}, {"workspace": np.empty(34, np.float32)},
                 {"method": "median"}):
    params, momentum = state()
    bad.append((params, momentum, kwargs, "workspace" if "workspace" in kwargs else "rda"))
  for params, momentum, kwargs, match in bad:
    before = _copy(params), _copy(momentum)
    with pytest.raises(ValueError, match=match):
      outer.merge_and_step(params, momentum, deltas, w, {"emb": True}, 0.5, 0.9, **kwargs)
    for tree, ref in zip((params, momentum), before):
      for k in tree:
        np.testing.assert_array_equal(tree[k], ref[k])
  params, momentum = state()
  params["other"] = np.ones(3, np.float32)  # tensors of other fragments are left alone
  outer.merge_and_step(params, momentum, deltas, w, {"emb": True}, 0.5, 0.9)
  np.testing.assert_array_equal(params["other"], np.ones(3, np.float32))


def test_merges_do_not_depend_on_the_thread_count(monkeypatch):
  monkeypatch.setattr(kernels, "CHUNK", 64)
  monkeypatch.setattr(kernels, "BLOCK_CHUNKS", 1)
  rng = np.random.default_rng(45)
  deltas = [{"a": rng.standard_normal((50, 41)).astype(np.float32),
             "e": rng.standard_normal(777).astype(np.float32)} for _ in range(6)]
  w = rng.uniform(0.1, 2.0, 6)
  results = []
  for threads in (1, 2, 3):
    monkeypatch.setattr(kernels, "MERGE_THREADS", threads)
    merged = outer.merge_fragment(deltas, w, {"e": True})
    params = {k: np.ones_like(v) for k, v in deltas[0].items()}
    momentum = {k: np.full_like(v, 0.5) for k, v in deltas[0].items()}
    step_sq = outer.merge_and_step(params, momentum, deltas, w, {"e": True}, 0.7, 0.9)
    results.append((merged, params, momentum, step_sq))
  for merged, params, momentum, step_sq in results[1:]:
    for got, want in zip((merged, params, momentum), results[0][:3]):
      for k in got:
        np.testing.assert_array_equal(got[k], want[k])
    assert step_sq == results[0][3]


def test_map_blocks_keeps_order_and_raises(monkeypatch):
  monkeypatch.setattr(kernels, "CHUNK", 4)
  monkeypatch.setattr(kernels, "BLOCK_CHUNKS", 1)
  monkeypatch.setattr(kernels, "MERGE_THREADS", 2)
  assert kernels.map_blocks(lambda lo, hi: (lo, hi), 10) == [(0, 4), (4, 8), (8, 10)]
  assert kernels.map_blocks(lambda lo, hi: lo, 0) == []

  def fail(lo, hi):
    if lo == 8:
      raise RuntimeError("block 8")
    return lo

  with pytest.raises(RuntimeError, match="block 8"):
    kernels.map_blocks(fail, 40)


# ---- Quantisers. ----

@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("block,size", [(32, 1000), (64, 64), (7, 99), (128, 5)])
def test_int_quantiser_error_within_half_a_step(bits, block, size):
  rng = np.random.default_rng(bits * 1000 + size)
  x = (rng.standard_normal(size) * rng.uniform(0.01, 100, size)).astype(np.float32)
  q = outer.quantize(x, bits, block)
  y = outer.dequantize(q)
  assert y.shape == x.shape and y.dtype == x.dtype
  num_blocks = -(-size // block)
  assert q.scales.shape == (num_blocks,)
  padded = np.zeros(num_blocks * block)
  padded[:size] = x
  maxabs = np.abs(padded.reshape(num_blocks, block)).max(axis=1)
  np.testing.assert_allclose(q.scales, maxabs / {8: 127, 4: 7, 2: 1}[bits], rtol=1e-6)
  per_elem_scale = np.repeat(q.scales.astype(np.float64), block)[:size]
  err = np.abs(x.astype(np.float64) - y)
  assert np.all(err <= per_elem_scale / 2 * (1 + 1e-5) + 1e-6 * np.abs(x))
  # The extreme of each block is represented (almost) exactly.
  i = int(np.argmax(np.abs(x[:block])))
  assert abs(y[i] - x[i]) <= 1e-5 * abs(x[i])


def test_int4_packs_two_per_byte_and_sizes():
  x = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
  q8, q4, q16 = outer.quantize(x, 8, 128), outer.quantize(x, 4, 128), outer.quantize(x, 16, 128)
  assert q8.values.dtype == np.int8 and q8.values.size == 4096
  assert q4.values.dtype == np.uint8 and q4.values.size == 2048
  assert q16.values.dtype == ml_dtypes.bfloat16
  assert q8.nbytes == 4096 + 32 * 4
  assert q4.nbytes == 2048 + 32 * 4
  assert q16.nbytes == 4096 * 2
  assert q4.nbytes < q8.nbytes < q16.nbytes < x.nbytes
  odd = outer.quantize(np.arange(-7, 8, dtype=np.float32), 4, 15)
  assert odd.values.size == 8  # 15 codes -> 8 bytes
  np.testing.assert_array_equal(outer.dequantize(odd), np.arange(-7, 8))


def test_bf16_relative_error():
  rng = np.random.default_rng(1)
  x = (rng.standard_normal(10000) * np.exp(rng.uniform(-20, 20, 10000))).astype(np.float32)
  y = outer.dequantize(outer.quantize(x, 16, 1))
  assert y.dtype == np.float32
  assert np.all(np.abs(y - x) <= 2.0 ** -8 * np.abs(x))


def test_quantise_edge_cases():
  z = outer.dequantize(outer.quantize(np.zeros((3, 5), np.float32), 8, 4))
  np.testing.assert_array_equal(z, np.zeros((3, 5)))
  with pytest.raises(ValueError, match=r"unsupported bits 3; allowed: \(16, 8, 4, 2, 1\)"):
    outer.quantize(np.ones(4), 3, 4)
  with pytest.raises(ValueError, match="block"):
    outer.quantize(np.ones(4), 8, 0)
  with pytest.raises(ValueError, match="non-finite"):
    outer.quantize(np.array([1.0, np.nan]), 8, 2)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_error_feedback_tracks_cumulative_sum(bits):
  rng = np.random.default_rng(bits)
  block = 16
  true_sum = np.zeros(256)
  sent_sum = np.zeros(256)
  residual = None
  plain_sum = np.zeros(256)
  for _ in range(50):
    x = (rng.standard_normal(256) * 0.01 + 0.003).astype(np.float32)
    q, residual = outer.quantize_with_feedback(x, residual, bits, block)
    true_sum += x
    sent_sum += outer.dequantize(q)
    plain_sum += outer.dequantize(outer.quantize(x, bits, block))
    step = np.repeat(q.scales.astype(np.float64), block)
    assert np.all(np.abs(true_sum - sent_sum) <= step / 2 * (1 + 1e-4) + 1e-6)
  np.testing.assert_allclose(true_sum - sent_sum, residual, atol=1e-5)
  # Without feedback the error accumulates well beyond one step.
  assert np.abs(true_sum - plain_sum).max() > 2 * np.abs(true_sum - sent_sum).max()


# ---- 2-bit and 1-bit payloads against an oracle written from their definitions. ----

def oracle_low_bit(x, bits, block):
  """float64 reconstruction, element by element: 2 bits round x / (max|x| of its block) to
  {-1, 0, 1}; 1 bit is sign(x) (zero counts as +) times the mean |x| of the block's elements."""
  x = np.asarray(x, np.float64).reshape(-1)
  out = np.zeros_like(x)
  for lo in range(0, x.size, block):
    part = x[lo:lo + block]
    if bits == 2:
      step = np.abs(part).max()
      out[lo:lo + block] = [0.0 if step == 0 else min(max(np.rint(v / step), -1), 1) * step
                            for v in part]
    else:
      mean = np.abs(part).mean()
      out[lo:lo + block] = [mean if v >= 0 else -mean for v in part]
  return out


def oracle_codes(values, bits):
  """Codes from the packed bytes, read bit by bit (bit i of byte j is element j * 8 + i)."""
  flat_bits = np.unpackbits(np.asarray(values, np.uint8), bitorder="little").astype(np.int64)
  if bits == 1:
    return 2 * flat_bits - 1
  fields = flat_bits.reshape(-1, bits) @ (1 << np.arange(bits))
  return np.where(fields >= 1 << (bits - 1), fields - (1 << bits), fields)


@pytest.mark.parametrize("bits", [2, 1])
@pytest.mark.parametrize("block,size", [(32, 1000), (64, 64), (7, 99), (128, 5), (3, 1)])
def test_low_bit_round_trip_matches_oracle(bits, block, size):
  rng = np.random.default_rng(bits * 7 + size)
  x = (rng.standard_normal(size) * rng.uniform(0.01, 100, size)).astype(np.float32)
  x[::11] = 0.0  # zeros: 2 bits keep them, 1 bit sends +mean
  q = outer.quantize(x.reshape(-1, 1), bits, block)
  y = outer.dequantize(q)
  assert y.shape == (size, 1) and y.dtype == np.float32
  assert q.values.dtype == np.uint8 and q.scales.shape == (-(-size // block),)
  np.testing.assert_allclose(y.reshape(-1), oracle_low_bit(x, bits, block), rtol=1e-6, atol=0)
  # The packed codes alone, read by the oracle, times the scales give the same tensor.
  codes = oracle_codes(q.values, bits)[:size]
  per_elem_scale = np.repeat(q.scales.astype(np.float64), block)[:size]
  np.testing.assert_allclose(codes * per_elem_scale, y.reshape(-1), rtol=1e-6)
  if bits == 1:  # signSGD with a scale keeps each block's L1 norm
    for lo in range(0, size, block):
      np.testing.assert_allclose(np.abs(y[lo:lo + block]).sum(),
                                 np.abs(x[lo:lo + block]).sum(), rtol=1e-5)


def test_low_bit_codes_pack_four_and_eight_per_byte():
  x = np.random.default_rng(3).standard_normal(4096).astype(np.float32)
  q4, q2, q1 = (outer.quantize(x, b, 128) for b in (4, 2, 1))
  assert q2.values.size == 1024 and q1.values.size == 512
  assert q2.nbytes == 1024 + 32 * 4  # 2.25 bits per value with the float32 scales
  assert q1.nbytes == 512 + 32 * 4  # 1.25 bits per value
  assert q1.nbytes < q2.nbytes < q4.nbytes < x.nbytes
  for bits, size, packed in ((2, 15, 4), (1, 15, 2), (1, 40, 5), (2, 1, 2)):  # tail padded
    q = outer.quantize(np.arange(size, dtype=np.float32) - 7, bits, 5)
    assert q.values.size == packed == outer.packed_size(-(-size // 5) * 5, bits)
  # A hand-packed byte: 2-bit codes 1, -1, 0, 1 are 0b01_00_11_01, first code lowest.
  q = outer.quantize(np.array([1.0, -1.0, 0.0, 1.0], np.float32), 2, 4)
  assert q.values.tolist() == [0b01001101]
  q = outer.quantize(np.array([1, -1, -1, 2, -3, 0, 5, -1], np.float32), 1, 8)
  assert q.values.tolist() == [0b01101001]


def test_low_bit_payloads_are_counted_at_their_true_size():
  from diloco.delivery import Delivery
  x = np.ones((64, 64), np.float32)
  sizes = {b: Delivery(learner=0, incarnation=0, fragment=0, local_step=1, steps=1, tokens=1,
                       base_version=0, kind="delta", tensors={"w": outer.quantize(x, b, 128)},
                       transit_s=0.0).nbytes
           for b in (8, 4, 2, 1)}
  assert sizes == {8: 4096 + 128, 4: 2048 + 128, 2: 1024 + 128, 1: 512 + 128}


@pytest.mark.parametrize("bits", [2, 1])
def test_low_bit_error_feedback_accumulates_the_residual(bits):
  rng = np.random.default_rng(10 + bits)
  block, n = 16, 256
  true_sum, sent_sum, plain_sum = np.zeros(n), np.zeros(n), np.zeros(n)
  residual = None
  for _ in range(60):
    x = (rng.standard_normal(n) * 0.01 + 0.003).astype(np.float32)
    target = x.astype(np.float64) + (0 if residual is None else residual)
    q, new_residual = outer.quantize_with_feedback(x, residual, bits, block)
    sent = outer.dequantize(q).astype(np.float64)
    # The payload quantises x plus the carried residual; the new residual is what it missed.
    np.testing.assert_allclose(sent, oracle_low_bit(target.astype(np.float32), bits, block),
                               rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(new_residual, target - sent, atol=1e-6)
    residual = new_residual
    true_sum += x
    sent_sum += sent
    plain_sum += outer.dequantize(outer.quantize(x, bits, block))
  np.testing.assert_allclose(true_sum - sent_sum, residual, atol=1e-5)
  # The residual stays bounded while plain quantisation drifts from the sum it should send.
  assert np.abs(true_sum - sent_sum).max() < 0.5 * np.abs(true_sum - plain_sum).max()
