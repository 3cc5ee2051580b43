/* Codelets: generation's key/value cache (append the new rows; attention of the new queries
 * over the cache), on the rows of a decode step described by idx (N,3): token, slot, position. */
#include "codelet.h"

/* kcache, vcache (S,NH,Tc,hs): RW, since the positions not in the step are kept; qkv (N,3C);
 * idx (N,3) */
SL_CODELET(kv_append, struct sl_kvcache_args, 0, 0.0, SL_RW, SL_RW, SL_R, SL_R)
{
	kv_append(SL_F(0), SL_F(1), SL_F(2), SL_I(3), a->N, a->C, a->NH, a->Tc);
}
SL_CUDA(kv_append)
{
	kv_append_cuda(g, SL_F(0), SL_F(1), SL_F(2), SL_I(3), a->N, a->C, a->NH, a->Tc);
}

/* out (N,C), qkv (N,3C), kcache, vcache (S,NH,Tc,hs), idx (N,3). The cost grows with the
 * rows' positions, which the perf model's footprint (the buffer sizes, fixed) does not see:
 * its history is an average over steps. */
SL_CODELET(attention_decode, struct sl_kvcache_args, 0, 0.0, SL_W, SL_R, SL_R, SL_R, SL_R)
{
	attention_decode(SL_F(0), SL_F(1), SL_F(2), SL_F(3), SL_I(4), a->N, a->C, a->NH, a->Tc);
}
SL_CUDA(attention_decode)
{
	attention_decode_cuda(g, SL_F(0), SL_F(1), SL_F(2), SL_F(3), SL_I(4), a->N, a->C, a->NH,
			      a->Tc);
}
