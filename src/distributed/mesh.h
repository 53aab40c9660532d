/* distributed/mesh.h: the device mesh of a run: how the MPI world splits into
 * data-parallel replicas, FSDP shard groups and tensor-parallel groups,
 * from [parallelism].
 *
 * The order is torchtitan's ["pp", "dp_replicate", "dp_shard", "cp", "tp"] with the
 * last dimension varying fastest, so a tensor-parallel group is made of
 * consecutive ranks (on one machine when ranks are packed by node):
 *   rank = pp_index * stage + ((replicate_index * dp_shard + shard_index) * cp + cp_index) * tp + tp_index,
 * stage = dp_replicate * dp_shard * cp * tp ranks holding one pipeline stage.
 * Data-parallel rank (which windows of data a rank reads) is
 * replicate_index * dp_shard + shard_index, over dp_replicate * dp_shard: the
 * context-parallel ranks of one sequence (distributed/cp.h) share it, as the
 * tensor-parallel ranks do, and each takes its chunk of every window.
 * An expert-parallel group is expert_parallel_degree consecutive
 * data-parallel ranks with the same cp and tp index (distributed/ep.h), inside one FSDP
 * group when dp_shard > 1 (ep must divide dp_shard), else among the replicas
 * (ep must divide dp_replicate). */
#ifndef CT_DISTRIBUTED_MESH_H
#define CT_DISTRIBUTED_MESH_H

#include "config/config.h"
#include "core/err.h"
#include "distributed/comm.h"
#include "model/lm.h"

typedef struct {
    ct_comm *world;
    int pp, pp_rank;  /* pipeline stages (1: off) and this rank's; the outermost dimension */
    int stage;        /* ranks per stage: world size / pp; the degrees below split them */
    ct_comm ppg;      /* the same place in every stage: one pipeline (its rank is pp_rank) */
    int dp_replicate, dp_shard, tp;  /* degrees; their product (x cp) is the world size */
    int cp, cp_rank;                 /* context parallel degree (1: off) and this rank's chunk */
    int rep_rank, shard_rank, tp_rank;
    int dp_rank, dp_size;            /* data-parallel coordinate over replicate x shard */
    ct_comm rep;    /* same shard, cp and tp index: the replicas of one shard (all-reduce of gradients) */
    ct_comm shard;  /* same replica, cp and tp index: one FSDP group */
    ct_comm dp;     /* same cp and tp index: every data-parallel rank (loss and token counts) */
    ct_comm tpg;    /* same replica, shard and cp index: one tensor-parallel group (consecutive ranks) */
    ct_comm cpg;    /* same replica, shard and tp index: the chunks of one sequence (only when cp > 1) */
    int ep, ep_rank; /* expert parallel degree (1: off) and this rank's index in its group */
    ct_comm epg;    /* expert_parallel_degree consecutive data-parallel ranks with this cp and tp index */
    ct_comm edp;    /* the ranks holding the same experts (same ep_rank, cp and tp index): within the
                     * FSDP group when dp_shard > 1 (the experts' FSDP group; dp_shard / ep ranks),
                     * else among the replicas (their gradients' all-reduce; dp_replicate / ep) */
    ct_comm slices; /* data-parallel ranks 0 .. ep-1 (of chunk 0 under cp), every tp index: together
                     * they hold the whole model (rank ep_rank * tp + tp_rank); a checkpoint is
                     * gathered over it.
                     * A rank outside it gets a group of its own. */
} ct_mesh;

/* Resolves the degrees (data_parallel_shard_degree -1 = the rest) and checks
 * them against the world size, the model's heads, kv heads, intermediate
 * size and experts.
 * Errors are CT_ERR_CONFIG naming the key and `where` (the config file).
 * Out: replicate, shard and tp degrees. */
int mesh_resolve(const ct_config *c, int world_size, const lm_config *mc, const char *where, int *dp_replicate,
                 int *dp_shard, int *tp, ct_err *e);
/* Resolves, then builds the sub-communicators (collective over the world). */
int mesh_init(ct_mesh *m, ct_comm *world, const ct_config *c, const lm_config *mc, const char *where,
              ct_err *e);
void mesh_free(ct_mesh *m);

#endif
