"""Page-score estimators for sparse decode attention, scored by mass recall against the exact attention.

Every estimator maps (queries q [G, NQ, D] of one KV head's group, key pages X [N, S, D], valid mask m [N, S],
softmax scale s) to a per-query-head score [G, NQ, N] in "log page mass" units (so that the "mass" group combine,
softmax over pages per query head summed over the group, is an estimate of the page's group attention mass).
MEM[name] = per-page statistics kept, in units of D values (kmin/kmax = 2.0; scalars count 1/D each).
"""
import torch

NEG = float("-inf")


def _masked_mean(X, m):
    mf = m.float()[..., None]
    n = mf.sum(1).clamp_min(1)  # [N, 1]
    mu = (X * mf).sum(1) / n
    return mu, n.squeeze(-1), mf


def _minmax(X, m):
    big = 3e38
    lo = torch.where(m[..., None], X, big).amin(1)
    hi = torch.where(m[..., None], X, -big).amax(1)
    return lo, hi


def bound(q, X, m, s):  # Quest: sum_i max(q_i lo_i, q_i hi_i) = q.c + |q|.h
    lo, hi = _minmax(X, m)
    c, h = (lo + hi) / 2, (hi - lo) / 2
    return s * (q @ c.T + q.abs() @ h.T)


def bound_shrink(lam):
    def f(q, X, m, s):
        lo, hi = _minmax(X, m)
        c, h = (lo + hi) / 2, (hi - lo) / 2
        return s * (q @ c.T + lam * (q.abs() @ h.T))
    return f


def mean(q, X, m, s):  # log(n) + s q.mu
    mu, n, _ = _masked_mean(X, m)
    return s * (q @ mu.T) + n.log()


def mean_nolog(q, X, m, s):
    mu, n, _ = _masked_mean(X, m)
    return s * (q @ mu.T)


def mean_gauss_diag(q, X, m, s):  # Gaussian LSE: log n + s q.mu + s^2/2 sum_i q_i^2 var_i
    mu, n, mf = _masked_mean(X, m)
    var = (((X - mu[:, None]) ** 2) * mf).sum(1) / n[:, None]
    return s * (q @ mu.T) + n.log() + 0.5 * s * s * ((q * q) @ var.T)


def mean_std_diag(lam):  # s (q.mu + lam * sqrt(sum_i q_i^2 var_i)) + log n : "max of a Gaussian sample" flavour
    def f(q, X, m, s):
        mu, n, mf = _masked_mean(X, m)
        var = (((X - mu[:, None]) ** 2) * mf).sum(1) / n[:, None]
        return s * (q @ mu.T + lam * ((q * q) @ var.T).clamp_min(0).sqrt()) + n.log()
    return f


def mean_radius(q, X, m, s):  # ball bound: s (q.mu + |q| r), r = max_t |k_t - mu|
    mu, n, mf = _masked_mean(X, m)
    r = torch.where(m, (X - mu[:, None]).norm(dim=-1), 0.0).amax(1)
    return s * (q @ mu.T + q.norm(dim=-1, keepdim=True) * r[None, None]) + n.log()


def mean_pc1(q, X, m, s):  # Gaussian LSE with covariance = top principal direction + isotropic remainder
    mu, n, mf = _masked_mean(X, m)
    Xc = (X - mu[:, None]) * mf
    cov = Xc.transpose(1, 2) @ Xc / n[:, None, None]  # [N, D, D]
    ev, evec = torch.linalg.eigh(cov)
    l1, u = ev[:, -1].clamp_min(0), evec[:, :, -1]  # [N], [N, D]
    D = X.shape[-1]
    rho = ((ev.sum(-1) - l1) / (D - 1)).clamp_min(0)
    qu = q @ u.T  # [G, NQ, N]
    qq = (q * q).sum(-1, keepdim=True)
    return s * (q @ mu.T) + n.log() + 0.5 * s * s * (l1 * qu ** 2 + rho * (qq - qu ** 2))


def _kmeans(X, m, k, iters=6):
    """Per-page k-means over valid tokens; farthest-point init. Returns centroids [N, k, D], counts [N, k],
    within-cluster mean squared deviation [N, k]."""
    N, S, D = X.shape
    mf = m.float()
    mu, n, _ = _masked_mean(X, m)
    cents = []
    d = torch.where(m, ((X - mu[:, None]) ** 2).sum(-1), -1.0)  # farthest from the mean first
    for _ in range(k):
        idx = d.argmax(1)
        c = X[torch.arange(N), idx]
        cents.append(c)
        dc = torch.where(m, ((X - c[:, None]) ** 2).sum(-1), -1.0)
        d = torch.minimum(torch.where(m, d, -1.0), dc) if len(cents) > 1 else dc
    C = torch.stack(cents, 1)  # [N, k, D]
    for _ in range(iters):
        dist = ((X[:, :, None] - C[:, None]) ** 2).sum(-1)  # [N, S, k]
        a = torch.nn.functional.one_hot(dist.argmin(-1), k).float() * mf[..., None]  # [N, S, k]
        cnt = a.sum(1)  # [N, k]
        newC = (a.transpose(1, 2) @ X) / cnt.clamp_min(1)[..., None]
        C = torch.where(cnt[..., None] > 0, newC, C)
    dist = ((X[:, :, None] - C[:, None]) ** 2).sum(-1)
    a = torch.nn.functional.one_hot(dist.argmin(-1), k).float() * mf[..., None]
    cnt = a.sum(1)
    C = torch.where(cnt[..., None] > 0, (a.transpose(1, 2) @ X) / cnt.clamp_min(1)[..., None], C)
    v = (a * ((X[:, :, None] - C[:, None]) ** 2).sum(-1)).sum(1) / cnt.clamp_min(1)  # [N, k]
    return C, cnt, v


def kmeans_est(k, iso_var=False):
    def f(q, X, m, s):
        C, cnt, v = _kmeans(X, m, k)
        D = X.shape[-1]
        sc = s * torch.einsum("gqd,nkd->gqnk", q, C) + cnt.clamp_min(1e-30).log().masked_fill(cnt == 0, NEG)
        if iso_var:
            sc = sc + 0.5 * s * s * (q * q).sum(-1)[..., None, None] * v / D
        return torch.logsumexp(sc, -1)
    return f


def bound_mean_blend(alpha):  # s (alpha * bound + (1 - alpha) * q.mu) + log n
    def f(q, X, m, s):
        return alpha * bound(q, X, m, s) + (1 - alpha) * mean(q, X, m, s)
    return f


def exact_max(q, X, m, s):  # not cheap: needs every key (reference)
    lg = torch.einsum("gqd,nsd->gqns", q, X) * s
    return lg.masked_fill(~m, NEG).amax(-1)


def exact_lse(q, X, m, s):  # not cheap: the oracle's per-head log page mass (up to a per-head constant)
    lg = torch.einsum("gqd,nsd->gqns", q, X) * s
    return torch.logsumexp(lg.masked_fill(~m, NEG), -1)


def bound_temp(tau):  # Quest bound, softmax temperature changed in the "mass" combine (no extra memory)
    def f(q, X, m, s):
        return tau * bound(q, X, m, s)
    return f


def subpage_bound(parts=2):  # minmax of `parts` equal sub-pages; page score = LSE_j (s bound_j + log n_j)
    def f(q, X, m, s):
        N, S, D = X.shape
        Xs, ms = X.reshape(N * parts, S // parts, D), m.reshape(N * parts, S // parts)
        b = bound(q, Xs, ms, s)  # [G, NQ, N*parts]
        n = ms.float().sum(1)
        b = b + n.clamp_min(1e-30).log().masked_fill(n == 0, NEG)
        return torch.logsumexp(b.view(*b.shape[:2], N, parts), -1)
    return f


def cluster_bound(k=2):  # k-means clusters of the page, minmax per cluster; LSE_j (s bound_j + log n_j)
    def f(q, X, m, s):
        N, S, D = X.shape
        C, cnt, _ = _kmeans(X, m, k)
        a = ((X[:, :, None] - C[:, None]) ** 2).sum(-1).argmin(-1)  # [N, S]
        outs = []
        for j in range(k):
            mj = m & (a == j)
            b = bound(q, X, mj | ~mj.any(1, keepdim=True), s)  # empty cluster: placeholder, masked below
            nj = mj.float().sum(1)
            outs.append(b + nj.clamp_min(1e-30).log().masked_fill(nj == 0, NEG))
        return torch.logsumexp(torch.stack(outs, -1), -1)
    return f


def _pc1(X, m):
    mu, n, mf = _masked_mean(X, m)
    Xc = (X - mu[:, None]) * mf
    cov = Xc.transpose(1, 2) @ Xc / n[:, None, None]
    ev, evec = torch.linalg.eigh(cov)
    l1, u = ev[:, -1].clamp_min(0), evec[:, :, -1]
    D = X.shape[-1]
    rho = ((ev.sum(-1) - l1) / (D - 1)).clamp_min(0)
    return mu, n, mf, Xc, l1, u, rho


def mean_pc1_twopoint(q, X, m, s):  # two points mu +- sqrt(l1) u (n/2 each) + isotropic residual Gaussian
    mu, n, mf, Xc, l1, u, rho = _pc1(X, m)
    qu = q @ u.T
    qq = (q * q).sum(-1, keepdim=True)
    a = s * l1.sqrt() * qu
    lcosh = a.abs() + torch.log1p(torch.exp(-2 * a.abs()))  # log(2 cosh a)
    return s * (q @ mu.T) + (n / 2).log() + lcosh + 0.5 * s * s * rho * (qq - qu ** 2)


def mean_pc1_range(q, X, m, s):  # mean + range of projections on PC1 (bound along u) + isotropic residual
    mu, n, mf, Xc, l1, u, rho = _pc1(X, m)
    proj = (Xc * 1.0) @ u[:, :, None]  # [N, S, 1]
    big = 3e38
    pmin = torch.where(m, proj[..., 0], big).amin(1)
    pmax = torch.where(m, proj[..., 0], -big).amax(1)
    qu = q @ u.T
    qq = (q * q).sum(-1, keepdim=True)
    return (s * (q @ mu.T + torch.maximum(qu * pmin, qu * pmax)) + n.log()
            + 0.5 * s * s * rho * (qq - qu ** 2))


def registry2(D=64):
    sc = 1.0 / D
    return {
        "bound (Quest, current)": (bound, 2.0),
        "bound temp 0.5": (bound_temp(0.5), 2.0),
        "bound temp 2": (bound_temp(2.0), 2.0),
        "bound shrink lam=0.75": (bound_shrink(0.75), 2.0),
        "bound shrink lam=0.5": (bound_shrink(0.5), 2.0),
        "minmax centre (lam=0)": (bound_shrink(0.0), 2.0),
        "mean": (mean, 1.0 + sc),
        "mean + diag-Gauss var": (mean_gauss_diag, 2.0 + sc),
        "mean + 2.0*diag-std": (mean_std_diag(2.0), 2.0 + sc),
        "mean + radius (ball bound)": (mean_radius, 1.0 + 2 * sc),
        "mean + PC1 Gauss": (mean_pc1, 2.0 + 3 * sc),
        "mean + PC1 two-point": (mean_pc1_twopoint, 2.0 + 3 * sc),
        "mean + PC1 range": (mean_pc1_range, 2.0 + 4 * sc),
        "0.75 bound + 0.25 mean": (bound_mean_blend(0.75), 3.0),
        "0.5 bound + 0.5 mean": (bound_mean_blend(0.5), 3.0),
        "2-means centroids": (kmeans_est(2), 2.0 + 2 * sc),
        "4-means centroids": (kmeans_est(4), 4.0 + 4 * sc),
        "2 sub-page minmax": (subpage_bound(2), 4.0),
        "2-cluster minmax": (cluster_bound(2), 4.0 + 2 * sc),
        "exact max-token (ref, all keys)": (exact_max, None),
        "exact page LSE (ref, all keys)": (exact_lse, None),
    }


def cluster_bound_max(k=2, lam=1.0):  # k-means clusters, (shrunk) minmax bound per cluster, page score = max_j
    def f(q, X, m, s):
        C, cnt, _ = _kmeans(X, m, k)
        a = ((X[:, :, None] - C[:, None]) ** 2).sum(-1).argmin(-1)
        outs = []
        for j in range(k):
            mj = m & (a == j)
            b = bound_shrink(lam)(q, X, mj | ~mj.any(1, keepdim=True), s)
            outs.append(b.masked_fill(~mj.any(1)[None, None], NEG))
        return torch.stack(outs, -1).amax(-1)
    return f


def kmeans_nocount(k):
    def f(q, X, m, s):
        C, cnt, _ = _kmeans(X, m, k)
        sc = (s * torch.einsum("gqd,nkd->gqnk", q, C)).masked_fill(cnt[None, None] == 0, NEG)
        return torch.logsumexp(sc, -1)
    return f


def registry3(D=64):
    sc = 1.0 / D
    return {
        "bound (Quest, current)": (bound, 2.0),
        "bound shrink lam=0.5": (bound_shrink(0.5), 2.0),
        "2-means centroids": (kmeans_est(2), 2.0 + 2 * sc),
        "2-means centroids, no counts": (kmeans_nocount(2), 2.0),
        "3-means centroids": (kmeans_est(3), 3.0 + 3 * sc),
        "2-cluster minmax, max": (cluster_bound_max(2), 4.0),
        "2-cluster minmax shrink 0.5, max": (cluster_bound_max(2, 0.5), 4.0),
        "2 sub-page minmax shrink 0.5": (lambda q, X, m, s: subpage_bound(2)(q, X, m, s) * 0 + torch.logsumexp(
            bound_shrink(0.5)(q, X.reshape(-1, X.shape[1] // 2, X.shape[2]), m.reshape(-1, X.shape[1] // 2), s
                              ).view(q.shape[0], q.shape[1], X.shape[0], 2), -1), 4.0),
        "4-means centroids": (kmeans_est(4), 4.0 + 4 * sc),
    }
