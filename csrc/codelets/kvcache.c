/* Codelets: generation's key/value cache (append the new positions; attention of the new
 * queries over the cache). */
#include "codelet.h"

struct sl_kvcache_args {
	int B, Tn, C, NH, maxT, pos;
};

/* kcache, vcache (B,NH,maxT,hs): RW, since the positions before pos are kept; qkv (B,Tn,3C) */
SL_CODELET(kv_append, SL_RW, SL_RW, SL_R)
SL_CPU_FUNC(kv_append, struct sl_kvcache_args)
{
	kv_append(SL_F(buffers, 0), SL_F(buffers, 1), SL_F(buffers, 2), a->B, a->Tn, a->C, a->NH,
		  a->maxT, a->pos);
}

/* out (B,Tn,C), qkv (B,Tn,3C), kcache, vcache (B,NH,maxT,hs). The cost grows with pos, which
 * the perf model's footprint (the buffer sizes, fixed) does not see: its history is an
 * average over positions. */
SL_CODELET(attention_decode, SL_W, SL_R, SL_R, SL_R)
SL_CPU_FUNC(attention_decode, struct sl_kvcache_args)
{
	attention_decode(SL_F(buffers, 0), SL_F(buffers, 1), SL_F(buffers, 2), SL_F(buffers, 3),
			 a->B, a->Tn, a->C, a->NH, a->maxT, a->pos);
}

int sl_submit_kv_append(sl_handle kcache, sl_handle vcache, sl_handle qkv, int B, int Tn, int C,
			int NH, int maxT, int pos)
{
	struct sl_kvcache_args a = { B, Tn, C, NH, maxT, pos };
	return SL_SUBMIT(kv_append, a, kcache, vcache, qkv);
}

int sl_submit_attention_decode(sl_handle out, sl_handle qkv, sl_handle kcache, sl_handle vcache,
			       int B, int Tn, int C, int NH, int maxT, int pos)
{
	struct sl_kvcache_args a = { B, Tn, C, NH, maxT, pos };
	return SL_SUBMIT(attention_decode, a, out, qkv, kcache, vcache);
}
