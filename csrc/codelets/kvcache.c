/* Codelets: generation's key/value cache (append the new positions; attention of the new
 * queries over the cache). */
#include "codelet.h"

/* kcache, vcache (B,NH,maxT,hs): RW, since the positions before pos are kept; qkv (B,Tn,3C) */
SL_CODELET(kv_append, struct sl_kvcache_args, 0, 0.0, SL_RW, SL_RW, SL_R)
{
	kv_append(SL_F(0), SL_F(1), SL_F(2), a->B, a->Tn, a->C, a->NH, a->maxT, a->pos);
}
SL_CUDA(kv_append)
{
	kv_append_cuda(g, SL_F(0), SL_F(1), SL_F(2), a->B, a->Tn, a->C, a->NH, a->maxT, a->pos);
}

/* out (B,Tn,C), qkv (B,Tn,3C), kcache, vcache (B,NH,maxT,hs). The cost grows with pos, which
 * the perf model's footprint (the buffer sizes, fixed) does not see: its history is an
 * average over positions. */
SL_CODELET(attention_decode, struct sl_kvcache_args, 0, 0.0, SL_W, SL_R, SL_R, SL_R)
{
	attention_decode(SL_F(0), SL_F(1), SL_F(2), SL_F(3), a->B, a->Tn, a->C, a->NH, a->maxT,
			 a->pos);
}
SL_CUDA(attention_decode)
{
	attention_decode_cuda(g, SL_F(0), SL_F(1), SL_F(2), SL_F(3), a->B, a->Tn, a->C, a->NH,
			      a->maxT, a->pos);
}
