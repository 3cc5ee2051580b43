/* Codelets: encoder (token + position embedding) forward and backward. */
#include "codelet.h"

/* out (B,T,C), inp (B,T), wte (Vp,C) in k = a->blocks row blocks, wpe (maxT,C) */
SL_CODELET_REPEAT(encoder_forward, struct sl_encoder_args, blocks, 0, 0.0, SL_W, SL_R,
		  SL_R | SL_REPEAT, SL_R)
{
	int k = a->blocks;
	float *wte[k];
	int rows[k];
	sl_row_blocks(b, 2, k, a->C, wte, rows);
	encoder_forward_blocks(SL_F(0), SL_I(1), (const float *const *)wte, rows, k,
			       SL_F(2 + k), a->B, a->T, a->C);
}
SL_CUDA(encoder_forward)
{
	int k = a->blocks;
	float *wte[k];
	int rows[k];
	sl_row_blocks(b, 2, k, a->C, wte, rows);
	encoder_forward_cuda(g, SL_F(0), SL_I(1), (const float *const *)wte, rows, k,
			     SL_F(2 + k), a->B, a->T, a->C);
}

/* Generation: out (N,C), idx (N,3) (token, slot, position of each row), wte (Vp,C) in
 * k = a->blocks row blocks, wpe (maxT,C) */
SL_CODELET_REPEAT(encoder_decode, struct sl_encoder_decode_args, blocks, 0, 0.0, SL_W, SL_R,
		  SL_R | SL_REPEAT, SL_R)
{
	int k = a->blocks;
	float *wte[k];
	int rows[k];
	sl_row_blocks(b, 2, k, a->C, wte, rows);
	encoder_decode_blocks(SL_F(0), SL_I(1), (const float *const *)wte, rows, k, SL_F(2 + k),
			      a->N, a->C);
}
SL_CUDA(encoder_decode)
{
	int k = a->blocks;
	float *wte[k];
	int rows[k];
	sl_row_blocks(b, 2, k, a->C, wte, rows);
	encoder_decode_cuda(g, SL_F(0), SL_I(1), (const float *const *)wte, rows, k, SL_F(2 + k),
			    a->N, a->C);
}
/* dwte (Vp,C) in k row blocks, dwpe (maxT,C), dout (B,T,C), inp (B,T) */
SL_CODELET_REPEAT(encoder_backward, struct sl_encoder_backward_args, blocks, 0, 0.0,
		  SL_GRAD | SL_REPEAT, SL_GRAD, SL_R, SL_R)
{
	int k = a->blocks;
	float *dwte[k];
	int rows[k];
	sl_row_blocks(b, 0, k, a->C, dwte, rows);
	encoder_backward_blocks(dwte, rows, k, SL_F(k), SL_F(k + 1), SL_I(k + 2), a->B, a->T, a->C);
}
SL_CUDA(encoder_backward)
{
	int k = a->blocks;
	float *dwte[k];
	int rows[k];
	sl_row_blocks(b, 0, k, a->C, dwte, rows);
	encoder_backward_cuda(g, dwte, rows, k, SL_F(k), SL_F(k + 1), SL_I(k + 2), a->B, a->T,
			      a->C);
}
