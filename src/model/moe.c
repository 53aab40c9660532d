/* model/moe.c: routing, its metadata and backward, and the load-balancing loss.
 *
 * The router is cheap next to the experts (E outputs per token), so it is
 * plain code here and only its matmul goes through the kernels. Top-k is a
 * partial selection per row (k passes over E), ordered by descending
 * probability with ties to the lower index; the metadata is a counting
 * sort of the N*k slots by expert, stable so each expert's rows keep token
 * order (deterministic, and the grouped kernel's gathers walk x forwards). */
#include "model/moe.h"

#include <math.h>
#include <string.h>

static size_t up16(size_t n) { return (n + 15) & ~(size_t)15; }

size_t moe_route_floats(int N, int E, int k) {
    size_t S = (size_t)N * k;
    return up16((size_t)N * E) + 4 * up16(S) + up16((size_t)E + 1);
}

void moe_route_bind(moe_route *r, float *mem, int N, int E, int k) {
    size_t S = (size_t)N * k;
    r->probs = mem;
    mem += up16((size_t)N * E);
    r->topw = mem;
    mem += up16(S);
    r->topi = (int32_t *)mem;
    mem += up16(S);
    r->perm = (int32_t *)mem;
    mem += up16(S);
    r->pos = (int32_t *)mem;
    mem += up16(S);
    r->offsets = (int32_t *)mem;
}

void moe_route_fwd(const kern_ops *kops, moe_route *r, const float *x, const float *wr, const uint16_t *wrh,
                   const float *bias, int N, int H, int E, int k, int norm) {
    moe_router_opt o = {norm, 0, 1, 1, 1.0f, 0.0f};
    moe_route_fwd_opt(kops, r, x, wr, wrh, bias, N, H, E, k, &o);
}

/* GLM-4.5's group limit: keep[g] = 1 for the topk_group groups of p + bias (E / G
 * experts each) whose two largest scores sum highest (ties: the lower group). */
static void moe_groups_keep(unsigned char *keep, const float *p, const float *bias, int E, int G, int topk_group) {
    float gs[MOE_MAX_GROUPS];
    int per = E / G;
    for (int g = 0; g < G; g++) {
        float a = -INFINITY, b = -INFINITY; /* the largest and the second */
        for (int e = g * per; e < (g + 1) * per; e++) {
            float s = bias ? p[e] + bias[e] : p[e];
            if (s > a) b = a, a = s;
            else if (s > b) b = s;
        }
        gs[g] = a + b;
        keep[g] = 0;
    }
    for (int j = 0; j < topk_group; j++) {
        int best = -1;
        for (int g = 0; g < G; g++)
            if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g;
        keep[best] = 1;
    }
}

void moe_route_fwd_opt(const kern_ops *kops, moe_route *r, const float *x, const float *wr, const uint16_t *wrh,
                       const float *bias, int N, int H, int E, int k, const moe_router_opt *o) {
    int norm = o->norm, G = o->n_group > 1 ? o->n_group : 1, per = E / G;
    /* logits [N, E], turned into scores (softmax or sigmoid) in place */
    if (wrh) kops->matmul_fwd_wbf16(r->probs, x, wrh, N, H, E, 0);
    else kops->matmul_fwd(r->probs, x, wr, N, H, E, 0);
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int t = 0; t < N; t++) {
            float *p = r->probs + (size_t)t * E;
            if (o->sigmoid) {
                for (int e = 0; e < E; e++) p[e] = 1.0f / (1.0f + expf(-p[e]));
            } else {
                float mx = p[0];
                for (int e = 1; e < E; e++) mx = p[e] > mx ? p[e] : mx;
                float sum = 0;
                for (int e = 0; e < E; e++) sum += (p[e] = expf(p[e] - mx));
                for (int e = 0; e < E; e++) p[e] /= sum;
            }
            unsigned char keep[MOE_MAX_GROUPS] = {1}; /* [G] the groups the choice may take */
            if (G > 1) moe_groups_keep(keep, p, bias, E, G, o->topk_group);
            float *w = r->topw + (size_t)t * k;
            int32_t *ix = r->topi + (size_t)t * k;
            float wsum = 0;
            for (int j = 0; j < k; j++) {
                int best = -1;
                for (int e = 0; e < E; e++) {
                    int taken = !keep[e / per];
                    for (int i = 0; i < j; i++) taken |= ix[i] == e;
                    if (!taken && (best < 0 || (bias ? p[e] + bias[e] > p[best] + bias[best] : p[e] > p[best])))
                        best = e;
                }
                ix[j] = best;
                w[j] = p[best];
                wsum += p[best];
            }
            if (norm && o->sigmoid) wsum += 1e-20f; /* Glm4MoeTopkRouter's denominator */
            if (norm && !o->sigmoid && wsum < o->norm_min) wsum = o->norm_min; /* Ernie4_5_MoeTopKRouter's clamp */
            if (norm)
                for (int j = 0; j < k; j++) w[j] /= wsum;
            if (o->sigmoid && o->scale != 1.0f) /* (moe_route_bwd's softmax path takes no scale) */
                for (int j = 0; j < k; j++) w[j] *= o->scale;
        }
        KERN_TRACE_EXIT(kt_);
    }
    long S = (long)N * k;
    memset(r->offsets, 0, ((size_t)E + 1) * sizeof(int32_t));
    for (long s = 0; s < S; s++) r->offsets[r->topi[s] + 1]++;
    for (int e = 0; e < E; e++) r->offsets[e + 1] += r->offsets[e];
    /* stable counting sort: offsets[e] serves as expert e's cursor (ending at
     * the start of e + 1), then shifts back to the starts */
    for (long s = 0; s < S; s++) {
        int32_t row = r->offsets[r->topi[s]]++;
        r->perm[row] = (int32_t)s;
        r->pos[s] = row;
    }
    for (int e = E - 1; e > 0; e--) r->offsets[e] = r->offsets[e - 1];
    r->offsets[0] = 0;
}

void moe_route_bwd(const kern_ops *kops, float *dx, float *dwr, float *dprobs, const float *dtopw,
                   const float *dprob_all, const float *x, const float *wr, const uint16_t *wrh, const moe_route *r,
                   int N, int H, int E, int k, int norm) {
    moe_router_opt o = {norm, 0, 1, 1, 1.0f, 0.0f};
    moe_route_bwd_opt(kops, dx, dwr, dprobs, dtopw, dprob_all, x, wr, wrh, r, N, H, E, k, &o);
}

void moe_route_bwd_opt(const kern_ops *kops, float *dx, float *dwr, float *dprobs, const float *dtopw,
                       const float *dprob_all, const float *x, const float *wr, const uint16_t *wrh,
                       const moe_route *r, int N, int H, int E, int k, const moe_router_opt *o) {
    int norm = o->norm;
    kern_trace *kt_ = kern_trace_armed();
#pragma omp parallel
    {
        KERN_TRACE_ENTER(kt_);
#pragma omp for schedule(static) nowait
        for (int t = 0; t < N; t++) {
            const float *p = r->probs + (size_t)t * E, *w = r->topw + (size_t)t * k, *dw = dtopw + (size_t)t * k;
            const int32_t *ix = r->topi + (size_t)t * k;
            float *dp = dprobs + (size_t)t * E;
            for (int e = 0; e < E; e++) dp[e] = dprob_all ? dprob_all[e] : 0.0f;
            if (o->sigmoid) {
                /* w_j = c s_j / S (S = sum_i s_i + 1e-20 when norm, else w_j = c s_j): ds_j =
                 * c (dw_j - sum_i dw_i s_i / S) / S, and dlogit = ds s (1 - s) */
                float S = 1e-20f, dot = 0;
                for (int j = 0; j < k; j++) S += p[ix[j]];
                for (int j = 0; j < k; j++) dot += dw[j] * (p[ix[j]] / S);
                for (int j = 0; j < k; j++) dp[ix[j]] += norm ? o->scale * (dw[j] - dot) / S : o->scale * dw[j];
                for (int e = 0; e < E; e++) dp[e] *= p[e] * (1.0f - p[e]);
                continue;
            }
            if (norm) {
                /* w_j = v_j / sum v: dv_j = (dw_j - sum_i dw_i w_i) / sum v, and sum v = v_j / w_j */
                float vsum = 0, dot = 0;
                for (int j = 0; j < k; j++) {
                    vsum += p[ix[j]];
                    dot += dw[j] * w[j];
                }
                /* under ERNIE's clamp (sum v < norm_min) w_j = v_j / norm_min, a constant: dv_j = dw_j / norm_min */
                if (vsum < o->norm_min)
                    for (int j = 0; j < k; j++) dp[ix[j]] += dw[j] / o->norm_min;
                else
                    for (int j = 0; j < k; j++) dp[ix[j]] += (dw[j] - dot) / vsum;
            } else {
                for (int j = 0; j < k; j++) dp[ix[j]] += dw[j];
            }
            /* softmax backward, in place: dlogit = p * (dp - sum p dp) */
            float s = 0;
            for (int e = 0; e < E; e++) s += p[e] * dp[e];
            for (int e = 0; e < E; e++) dp[e] = p[e] * (dp[e] - s);
        }
        KERN_TRACE_EXIT(kt_);
    }
    if (!wrh) kops->matmul_bwd(dx, dwr, dprobs, x, wr, N, H, E, 1);
    else if (dx) kops->matmul_dinp_wbf16(dx, dprobs, wrh, N, H, E, E, 1); /* a stored router is frozen: no dwr */
}

void moe_route_stats(double *count, double *psum, const moe_route *r, int N, int E, int k_probs) {
    if (!k_probs)
        for (int e = 0; e < E; e++) count[e] += r->offsets[e + 1] - r->offsets[e];
    for (int t = 0; t < N && k_probs; t++) { /* the k largest probabilities, whatever chose the experts */
        const float *p = r->probs + (size_t)t * E;
        for (int e = 0; e < E; e++) {
            int above = 0; /* experts ranked before e: larger, or equal at a lower index */
            for (int x = 0; x < E && above < k_probs; x++) above += p[x] > p[e] || (p[x] == p[e] && x < e);
            count[e] += above < k_probs;
        }
    }
    for (int t = 0; t < N; t++)
        for (int e = 0; e < E; e++) psum[e] += r->probs[(size_t)t * E + e];
}

void moe_load_range(const double *count, int E, int *lo, int *hi) {
    double mn = count[0], mx = count[0];
    for (int e = 1; e < E; e++) {
        mn = count[e] < mn ? count[e] : mn;
        mx = count[e] > mx ? count[e] : mx;
    }
    *lo = (int)mn, *hi = (int)mx;
}

void moe_update_bias(float *bias, double *tokens, int E, double coeff) {
    double mean = 0, dmean = 0;
    for (int e = 0; e < E; e++) mean += tokens[e] / E;
    for (int e = 0; e < E; e++) {
        double d = coeff * (tokens[e] < mean ? 1.0 : tokens[e] > mean ? -1.0 : 0.0);
        tokens[e] = d; /* the delta, until re-centred */
        dmean += d / E;
    }
    for (int e = 0; e < E; e++) {
        bias[e] += (float)(tokens[e] - dmean);
        tokens[e] = 0;
    }
}

double moe_aux_loss(float *dprob_all, const double *count, const double *psum, int N, int n_layers, int E,
                    double scale) {
    double R = (double)N * n_layers, aux = 0;
    if (R <= 0) return 0;
    if (psum)
        for (int e = 0; e < E; e++) aux += (count[e] / R) * (psum[e] / R);
    if (dprob_all)
        for (int e = 0; e < E; e++) dprob_all[e] = (float)(scale * E * count[e] / (R * R));
    return aux * E;
}
