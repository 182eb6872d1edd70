// A sketch, not part of txlserve (nothing builds or imports it): the attention's passes over a ring of layer
// inputs h (keys and values absorbed: scores (W_k^T q) . h_j, values W_v sum_j p_j h_j), for H=4 heads and
// d_model 256, fp32, AVX-512. It times those passes for B sessions x L layers of M rows, random data, on one
// thread: the measurement behind BENCHMARKS.md, "The one way past DRAM at batch 16" (the product's kernel is
// model/kernels/attend_absorbed.c).
//   gcc -O3 -march=native -o absorbed bench/sketches/absorbed_attention.c -lm && ./absorbed 16 6 1600
// A fourth argument times scores, softmax and values as three passes over the ring instead of one fused pass.
// Leaves out the position term, the heads' projections and the feed-forward, which the whole step adds.
#include <immintrin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define H 4
#define D 256
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static inline __m512 vexp(__m512 x){
  x=_mm512_max_ps(x,_mm512_set1_ps(-87.f));
  __m512 k=_mm512_roundscale_ps(_mm512_mul_ps(x,_mm512_set1_ps(1.44269504f)),_MM_FROUND_TO_NEAREST_INT|_MM_FROUND_NO_EXC);
  __m512 r=_mm512_fnmadd_ps(k,_mm512_set1_ps(0.693145752f),x); r=_mm512_fnmadd_ps(k,_mm512_set1_ps(1.42860677e-6f),r);
  __m512 p=_mm512_set1_ps(1.9875691500E-4f); p=_mm512_fmadd_ps(p,r,_mm512_set1_ps(1.3981999507E-3f));
  p=_mm512_fmadd_ps(p,r,_mm512_set1_ps(8.3334519073E-3f)); p=_mm512_fmadd_ps(p,r,_mm512_set1_ps(4.1665795894E-2f));
  p=_mm512_fmadd_ps(p,r,_mm512_set1_ps(1.6666665459E-1f)); p=_mm512_fmadd_ps(p,r,_mm512_set1_ps(5.0000001201E-1f));
  p=_mm512_fmadd_ps(_mm512_mul_ps(p,r),r,_mm512_add_ps(r,_mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p,k);}
static inline float hsum(__m512 v){return _mm512_reduce_add_ps(v);}
// scores[h][j] = qa[h] . hr[j]
static void pass1(const float*qa,const float*hr,int M,float*s){
  int j=0;
  for(;j+6<=M;j+=6){
    __m512 acc[H][6];
    for(int h=0;h<H;h++)for(int r=0;r<6;r++)acc[h][r]=_mm512_setzero_ps();
    for(int d=0;d<D;d+=16){
      __m512 q0=_mm512_loadu_ps(qa+0*D+d),q1=_mm512_loadu_ps(qa+1*D+d),q2=_mm512_loadu_ps(qa+2*D+d),q3=_mm512_loadu_ps(qa+3*D+d);
      for(int r=0;r<6;r++){__m512 x=_mm512_loadu_ps(hr+(size_t)(j+r)*D+d);
        acc[0][r]=_mm512_fmadd_ps(q0,x,acc[0][r]);acc[1][r]=_mm512_fmadd_ps(q1,x,acc[1][r]);
        acc[2][r]=_mm512_fmadd_ps(q2,x,acc[2][r]);acc[3][r]=_mm512_fmadd_ps(q3,x,acc[3][r]);}
    }
    for(int h=0;h<H;h++)for(int r=0;r<6;r++)s[h*M+j+r]=hsum(acc[h][r]);
  }
  for(;j<M;j++)for(int h=0;h<H;h++){__m512 a=_mm512_setzero_ps();for(int d=0;d<D;d+=16)a=_mm512_fmadd_ps(_mm512_loadu_ps(qa+h*D+d),_mm512_loadu_ps(hr+(size_t)j*D+d),a);s[h*M+j]=hsum(a);}
}
static void softmax(float*s,int M){for(int h=0;h<H;h++){float m=-1e30f;for(int j=0;j<M;j++)if(s[h*M+j]>m)m=s[h*M+j];float z=0;for(int j=0;j<M;j++){s[h*M+j]=expf(s[h*M+j]-m);z+=s[h*M+j];}for(int j=0;j<M;j++)s[h*M+j]/=z;}}
// agg[h][:] = sum_j p[h][j] hr[j]   (tiles of 64 rows, d in chunks of 64)
static void pass2(const float*p,const float*hr,int M,float*agg){
  memset(agg,0,sizeof(float)*H*D);
  for(int j0=0;j0<M;j0+=64){int j1=j0+64<M?j0+64:M;
    for(int d=0;d<D;d+=64){
      __m512 a[H][4];for(int h=0;h<H;h++)for(int c=0;c<4;c++)a[h][c]=_mm512_loadu_ps(agg+h*D+d+16*c);
      for(int j=j0;j<j1;j++){const float*x=hr+(size_t)j*D+d;
        __m512 x0=_mm512_loadu_ps(x),x1=_mm512_loadu_ps(x+16),x2=_mm512_loadu_ps(x+32),x3=_mm512_loadu_ps(x+48);
        for(int h=0;h<H;h++){__m512 w=_mm512_set1_ps(p[h*M+j]);
          a[h][0]=_mm512_fmadd_ps(w,x0,a[h][0]);a[h][1]=_mm512_fmadd_ps(w,x1,a[h][1]);
          a[h][2]=_mm512_fmadd_ps(w,x2,a[h][2]);a[h][3]=_mm512_fmadd_ps(w,x3,a[h][3]);}}
      for(int h=0;h<H;h++)for(int c=0;c<4;c++)_mm512_storeu_ps(agg+h*D+d+16*c,a[h][c]);
    }}
}
// one pass: tiles of T rows, scores, online softmax, values, while the tile is in L1/L2
#ifndef T
#define T 48
#endif
#ifndef PF
#define PF 1
#endif
static void fused(const float*qa,const float*hr,int M,float*agg){
  float m[H],z[H],st[H*T]; for(int h=0;h<H;h++){m[h]=-1e30f;z[h]=0;} memset(agg,0,sizeof(float)*H*D);
  for(int j0=0;j0<M;j0+=T){int n=j0+T<M?T:M-j0;
    float s[H*T]; pass1(qa,hr+(size_t)j0*D,n,s);  // s[h*n+r]
    for(int h=0;h<H;h++){float mx=m[h];for(int r=0;r<n;r++)if(s[h*n+r]>mx)mx=s[h*n+r];
      float sc=expf(m[h]-mx); m[h]=mx; z[h]*=sc; if(sc!=1.f)for(int d=0;d<D;d++)agg[h*D+d]*=sc;
      int r=0; for(;r+16<=n;r+=16){__m512 e=vexp(_mm512_sub_ps(_mm512_loadu_ps(s+h*n+r),_mm512_set1_ps(mx)));_mm512_storeu_ps(st+h*T+r,e);z[h]+=hsum(e);}
      for(;r<n;r++){st[h*T+r]=expf(s[h*n+r]-mx);z[h]+=st[h*T+r];}}
    for(int d=0;d<D;d+=64){
      __m512 a[H][4];for(int h=0;h<H;h++)for(int c=0;c<4;c++)a[h][c]=_mm512_loadu_ps(agg+h*D+d+16*c);
      for(int r=0;r<n;r++){const float*x=hr+(size_t)(j0+r)*D+d;
        if(PF && j0+T+r<M){const char*nx=(const char*)(hr+(size_t)(j0+T+r)*D+d);_mm_prefetch(nx,_MM_HINT_T0);_mm_prefetch(nx+64,_MM_HINT_T0);_mm_prefetch(nx+128,_MM_HINT_T0);_mm_prefetch(nx+192,_MM_HINT_T0);}
        __m512 x0=_mm512_loadu_ps(x),x1=_mm512_loadu_ps(x+16),x2=_mm512_loadu_ps(x+32),x3=_mm512_loadu_ps(x+48);
        for(int h=0;h<H;h++){__m512 w=_mm512_set1_ps(st[h*T+r]);
          a[h][0]=_mm512_fmadd_ps(w,x0,a[h][0]);a[h][1]=_mm512_fmadd_ps(w,x1,a[h][1]);
          a[h][2]=_mm512_fmadd_ps(w,x2,a[h][2]);a[h][3]=_mm512_fmadd_ps(w,x3,a[h][3]);}}
      for(int h=0;h<H;h++)for(int c=0;c<4;c++)_mm512_storeu_ps(agg+h*D+d+16*c,a[h][c]);}
  }
  for(int h=0;h<H;h++)for(int d=0;d<D;d++)agg[h*D+d]/=z[h];
}
int main(int argc,char**argv){
  int B=atoi(argv[1]),L=atoi(argv[2]),M=atoi(argv[3]);
  size_t n=(size_t)B*L*M*D; float*ring=malloc(n*4); for(size_t i=0;i<n;i++)ring[i]=(float)((i*2654435761u)%1000)/1000.f-0.5f;
  float qa[H*D],agg[H*D],*s=malloc(sizeof(float)*H*M); for(int i=0;i<H*D;i++)qa[i]=0.01f*(i%7);
  double best=1e9; float chk=0;
  for(int it=0;it<7;it++){double t=now();
    for(int b=0;b<B;b++)for(int l=0;l<L;l++){const float*hr=ring+((size_t)b*L+l)*M*D; if(argc>4){pass1(qa,hr,M,s); softmax(s,M); pass2(s,hr,M,agg);} else fused(qa,hr,M,agg); chk+=agg[3];}
    t=now()-t; if(t<best)best=t;}
  double bytes=(double)n*4, macs=(double)B*L*M*H*D*2;
  printf("B=%d L=%d M=%d: %.2f ms/step, ring %.0f MB read at %.1f GB/s, %.1f GMAC/s (chk %g)\n",B,L,M,best*1e3,bytes/1e6,bytes/best/1e9,macs/best/1e9,chk);
  return 0;}
