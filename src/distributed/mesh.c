/* distributed/mesh.c: [parallelism] degrees -> checked mesh -> sub-communicators.
 * Every check runs before the model is built, with the world size known,
 * so a bad layout costs nothing and names the key to change. */
#include "distributed/mesh.h"

#include <string.h>

int mesh_resolve(const ct_config *c, int world, const lm_config *mc, const char *where, int *rep_out,
                 int *shard_out, int *tp_out, ct_err *e) {
    int rep = c->dp_replicate, tp = c->tp, shard = c->dp_shard, pp = c->pp > 1 ? c->pp : 1;
    /* pipeline stages are the outermost dimension: the other degrees split each stage's ranks */
    if (world % pp != 0)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: parallelism.pipeline_parallel_degree = %d does not divide the world size %d (ranks "
                       "started by mpirun -np)",
                       where, pp, world);
    if (pp > mc->n_layers)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: parallelism.pipeline_parallel_degree = %d: the model has only %d layers (a stage needs one)",
                       where, pp, mc->n_layers);
    world /= pp;
    /* context parallel (distributed/cp.h): each sequence's chunks over cp ranks that
     * otherwise act as one data-parallel rank; the degrees below split what is left */
    int cp = c->cp > 1 ? c->cp : 1;
    if (world % cp != 0)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: parallelism.context_parallel_degree = %d does not divide the world size %d (ranks "
                       "started by mpirun -np)%s",
                       where, cp, world * pp, pp > 1 ? " / pipeline_parallel_degree" : "");
    world /= cp;
    /* after pp and cp: what the messages below name as the divisor of the world size */
    const char *by = pp > 1 && cp > 1 ? " / pipeline_parallel_degree / context_parallel_degree"
                     : pp > 1         ? " / pipeline_parallel_degree"
                     : cp > 1         ? " / context_parallel_degree"
                                      : "";
    int all = world * pp * cp;
    /* the model's shape first: it does not depend on how many ranks were started */
    int dense = 0, sparse = 0; /* which MLP kinds the model has: only those are split */
    for (int l = 0; l < mc->n_layers; l++) {
        if (lm_layer_is_moe(mc, l)) sparse = 1;
        else dense = 1;
    }
    /* the config.json keys of the experts' and the shared MLP's widths: OLMoE's, FlexOlmo's and
     * GraniteMoE's experts are intermediate_size wide, GraniteMoeShared's shared MLP is shared_intermediate_size */
    int granite = mc->moe_keys == LM_MOE_KEYS_GRANITE;
    int olmoe = !strcmp(mc->model_type, "olmoe") || !strcmp(mc->model_type, "flex_olmo");
    struct { const char *what; int n, used; } split[] = {
        {"attention heads", mc->n_heads, 1},
        {"kv heads", mc->n_kv_heads, 1},
        {"intermediate size", mc->intermediate, dense},
        /* each expert is split like the MLP */
        {granite || olmoe ? "experts' intermediate_size" : "moe_intermediate_size", mc->moe_intermediate, sparse},
        /* a sparse layer's shared expert (qwen2_moe, granitemoeshared) too */
        {granite ? "shared_intermediate_size" : "shared_expert_intermediate_size", mc->shared_intermediate,
         sparse && mc->shared_intermediate > 0}};
    /* not the vocabulary: tp_local_config cuts it in DTensor Shard(0)'s ceil chunks, whatever tp */
    for (size_t i = 0; i < sizeof split / sizeof split[0]; i++)
        if (split[i].used && split[i].n % tp != 0)
            return ct_fail(e, CT_ERR_CONFIG,
                           "%s: parallelism.tensor_parallel_degree = %d does not divide the model's %s (%d)", where,
                           tp, split[i].what, split[i].n);
    if (c->ep > 1) {
        if (mc->n_experts == 0)
            return ct_fail(e, CT_ERR_CONFIG,
                           "%s: parallelism.expert_parallel_degree = %d but the model %s has no experts", where,
                           c->ep, mc->name);
        if (mc->n_experts % c->ep != 0)
            return ct_fail(e, CT_ERR_CONFIG,
                           "%s: parallelism.expert_parallel_degree = %d does not divide the model's %d experts",
                           where, c->ep, mc->n_experts);
    }
    if (world % (rep * tp) != 0)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: parallelism.data_parallel_replicate_degree (%d) x parallelism.tensor_parallel_degree "
                       "(%d) = %d does not divide the world size %d (ranks started by mpirun -np)%s",
                       where, rep, tp, rep * tp, all, by);
    if (shard == -1) shard = world / (rep * tp);
    if (rep * shard * tp != world)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: parallelism.data_parallel_replicate_degree (%d) x parallelism.data_parallel_shard_degree "
                       "(%d) x parallelism.tensor_parallel_degree (%d) = %d, but the world size is %d (ranks "
                       "started by mpirun -np)%s; set data_parallel_shard_degree = -1 to use the rest",
                       where, rep, shard, tp, rep * shard * tp, all, by);
    /* an EP group lies inside one FSDP group (or, without FSDP, among the
     * replicas), so the ranks that hold the same experts form a regular
     * sub-group of it (mesh.h: edp) */
    if (c->ep > 1 && rep * shard < c->ep) /* too few ranks: say how many there are and where they came from */
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: parallelism.expert_parallel_degree = %d needs at least %d data-parallel ranks, but "
                       "there are %d (data_parallel_replicate_degree %d x data_parallel_shard_degree %d%s: %d "
                       "ranks started by mpirun -np%s%s)",
                       where, c->ep, c->ep, rep * shard, rep, shard, c->dp_shard == -1 ? " from -1" : "",
                       all, pp > 1 ? ", over pipeline_parallel_degree stages" : "",
                       tp > 1 ? ", over tensor_parallel_degree" : "");
    if (c->ep > 1 && shard > 1 && shard % c->ep != 0)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: parallelism.expert_parallel_degree = %d does not divide "
                       "parallelism.data_parallel_shard_degree = %d (expert parallel groups are carved from the "
                       "FSDP ranks)",
                       where, c->ep, shard);
    if (c->ep > 1 && shard == 1 && rep % c->ep != 0)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: parallelism.expert_parallel_degree = %d does not divide the data-parallel ranks "
                       "(data_parallel_replicate_degree = %d)",
                       where, c->ep, rep);
    *rep_out = rep;
    *shard_out = shard;
    *tp_out = tp;
    return 0;
}

int mesh_init(ct_mesh *m, ct_comm *world, const ct_config *c, const lm_config *mc, const char *where,
              ct_err *e) {
    memset(m, 0, sizeof *m);
    m->world = world;
    int rc = mesh_resolve(c, world->size, mc, where, &m->dp_replicate, &m->dp_shard, &m->tp, e);
    if (rc) return rc;
    /* rank = pp_rank * stage + r: every group below lies inside one stage
     * (its colors carry pp_rank), the pipeline group across them */
    m->pp = c->pp > 1 ? c->pp : 1;
    m->stage = world->size / m->pp;
    m->pp_rank = world->rank / m->stage;
    int r = world->rank % m->stage, P = m->pp, pr = m->pp_rank;
    if ((rc = comm_split(world, r, m->pp_rank, &m->ppg, e))) return rc;
    m->cp = c->cp > 1 ? c->cp : 1;
    int C = m->cp;
    m->tp_rank = r % m->tp;
    m->cp_rank = (r / m->tp) % C;
    m->shard_rank = (r / (m->tp * C)) % m->dp_shard;
    m->rep_rank = r / (m->tp * C * m->dp_shard);
    m->dp_rank = m->rep_rank * m->dp_shard + m->shard_rank;
    m->dp_size = m->dp_replicate * m->dp_shard;
    /* (cp index, tp index): the place of a rank inside its data-parallel rank; with cp = 1 the tp index */
    int ct = m->cp_rank * m->tp + m->tp_rank;
#define IN_STAGE(color) ((color) * P + pr)
    if ((rc = comm_split(world, IN_STAGE(m->shard_rank * C * m->tp + ct), m->rep_rank, &m->rep, e))) return rc;
    if ((rc = comm_split(world, IN_STAGE(m->rep_rank * C * m->tp + ct), m->shard_rank, &m->shard, e))) return rc;
    if ((rc = comm_split(world, IN_STAGE(ct), m->dp_rank, &m->dp, e))) return rc;
    if ((rc = comm_split(world, IN_STAGE(m->dp_rank * C + m->cp_rank), m->tp_rank, &m->tpg, e))) return rc;
    if (C > 1 && (rc = comm_split(world, IN_STAGE(m->dp_rank * m->tp + m->tp_rank), m->cp_rank, &m->cpg, e)))
        return rc;
    m->ep = c->ep > 1 ? c->ep : 1;
    /* a checkpoint is gathered from chunk 0's ranks (the others hold the same model;
     * plan_save_gather leaves them out of its TP and FSDP gathers too) */
    int in = m->dp_rank < m->ep && m->cp_rank == 0;
    if ((rc = comm_split(world, IN_STAGE(in ? 0 : 1 + r), in ? m->dp_rank * m->tp + m->tp_rank : 0, &m->slices, e)))
        return rc;
    if (m->ep <= 1) return 0;
    /* consecutive data-parallel ranks with the same cp and tp index (ct): under TP
     * each rank of the group holds the same tp slice of its experts, and under CP
     * the group exchanges one chunk's tokens, whose experts' gradients the cp group
     * then sums as the rest (plan_reduce_grads) */
    m->ep_rank = m->dp_rank % m->ep;
    if ((rc = comm_split(world, IN_STAGE((m->dp_rank / m->ep) * C * m->tp + ct), m->ep_rank, &m->epg, e)))
        return rc;
    if (m->dp_shard > 1)
        return comm_split(world, IN_STAGE((m->rep_rank * C * m->tp + ct) * m->ep + m->ep_rank), m->shard_rank,
                          &m->edp, e);
    return comm_split(world, IN_STAGE(ct * m->ep + m->ep_rank), m->rep_rank, &m->edp, e);
#undef IN_STAGE
}

void mesh_free(ct_mesh *m) {
    if (m->rep.be) comm_free(&m->rep);
    if (m->shard.be) comm_free(&m->shard);
    if (m->dp.be) comm_free(&m->dp);
    if (m->tpg.be) comm_free(&m->tpg);
    if (m->epg.be) comm_free(&m->epg);
    if (m->edp.be) comm_free(&m->edp);
    if (m->slices.be) comm_free(&m->slices);
    if (m->cpg.be) comm_free(&m->cpg);
    if (m->ppg.be) comm_free(&m->ppg);
    memset(m, 0, sizeof *m);
}
