/* Codelets: matmul forward and backward (the linear layers and the tied lm head, whose
 * weight, wte, may come in k = a->blocks row blocks). */
#include "codelet.h"

/* out (N,OC), inp (N,C), weight (OC,C) in k row blocks, [bias (OC)] */
SL_CODELET_REPEAT(matmul_forward, struct sl_matmul_args, blocks, 0,
		  2.0 * a->N * a->C * a->OC + (n > 2 + a->blocks ? (double)a->N * a->OC : 0.0),
		  SL_W, SL_R, SL_R | SL_REPEAT, SL_R | SL_OPT)
{
	int k = a->blocks;
	float *weight[k];
	int rows[k];
	sl_row_blocks(b, 2, k, a->C, weight, rows);
	matmul_forward_blocks(SL_F(0), SL_F(1), (const float *const *)weight, rows, k,
			      n > 2 + k ? SL_F(2 + k) : NULL, a->N, a->C, a->OC);
}
SL_CUDA(matmul_forward)
{
	int k = a->blocks;
	float *weight[k];
	int rows[k];
	sl_row_blocks(b, 2, k, a->C, weight, rows);
	matmul_forward_cuda(g, SL_F(0), SL_F(1), (const float *const *)weight, rows, k,
			    n > 2 + k ? SL_F(2 + k) : NULL, a->N, a->C, a->OC);
}

/* dinp (N,C), dweight (OC,C) in k row blocks, dout (N,OC), inp, weight in the same k row
 * blocks, [dbias (OC)]. dinp = dout weight and dweight += dout^T inp: 2 N C OC flops each;
 * dbias += column sums. */
SL_CODELET_REPEAT(matmul_backward, struct sl_matmul_args, blocks, 0,
		  4.0 * a->N * a->C * a->OC +
			  (n > 3 + 2 * a->blocks ? (double)a->N * a->OC : 0.0),
		  SL_W, SL_GRAD | SL_REPEAT, SL_R, SL_R, SL_R | SL_REPEAT, SL_GRAD | SL_OPT)
{
	int k = a->blocks;
	float *dweight[k], *weight[k];
	int rows[k];
	sl_row_blocks(b, 1, k, a->C, dweight, rows);
	sl_row_blocks(b, 3 + k, k, a->C, weight, rows);
	matmul_backward_blocks(SL_F(0), dweight, n > 3 + 2 * k ? SL_F(3 + 2 * k) : NULL,
			       SL_F(1 + k), SL_F(2 + k), (const float *const *)weight, rows, k,
			       a->N, a->C, a->OC);
}
SL_CUDA(matmul_backward)
{
	int k = a->blocks;
	float *dweight[k], *weight[k];
	int rows[k];
	sl_row_blocks(b, 1, k, a->C, dweight, rows);
	sl_row_blocks(b, 3 + k, k, a->C, weight, rows);
	matmul_backward_cuda(g, SL_F(0), dweight, n > 3 + 2 * k ? SL_F(3 + 2 * k) : NULL,
			     SL_F(1 + k), SL_F(2 + k), (const float *const *)weight, rows, k, a->N,
			     a->C, a->OC);
}
