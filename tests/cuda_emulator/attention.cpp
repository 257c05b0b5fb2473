// Runs the attention family's fused forward kernel on the host emulator.
// usage: attention bf16|f16 B T NH HS qkv.bin out.bin lse.bin
// qkv.bin: (B,T,3C) 16-bit words; writes out (B,T,C) 16-bit words and lse (B,NH,T) f32.
#include "emulate.hpp"
#include "attention.cu"

template <typename T>
static std::vector<T> read_all(const char* path, size_t n) {
    std::vector<T> v(n);
    FILE* f = std::fopen(path, "rb");
    if (!f || std::fread(v.data(), sizeof(T), n, f) != n) { std::fprintf(stderr, "cannot read %zu values from %s\n", n, path); std::exit(2); }
    std::fclose(f);
    return v;
}

template <typename T>
static void write_all(const char* path, const std::vector<T>& v) {
    FILE* f = std::fopen(path, "wb");
    if (!f || std::fwrite(v.data(), sizeof(T), v.size(), f) != v.size()) { std::fprintf(stderr, "cannot write %s\n", path); std::exit(2); }
    std::fclose(f);
}

int main(int argc, char** argv) {
    if (argc != 9) { std::fprintf(stderr, "usage: attention bf16|f16 B T NH HS qkv.bin out.bin lse.bin\n"); return 2; }
    const bool bf16 = std::strcmp(argv[1], "bf16") == 0;
    const int B = std::atoi(argv[2]), T = std::atoi(argv[3]), NH = std::atoi(argv[4]), HS = std::atoi(argv[5]);
    const size_t C = (size_t)NH * HS;
    auto qkv = read_all<unsigned short>(argv[6], (size_t)B * T * 3 * C);
    std::vector<unsigned short> out((size_t)B * T * C, 0xffff);  // NaN until written
    std::vector<float> lse((size_t)B * NH * T, NAN);
    const float scale = 1.f / std::sqrt((float)HS);
    auto* o = out.data();
    auto* x = qkv.data();
    auto* l = lse.data();
    auto* of = reinterpret_cast<f16_t*>(o);
    auto* xf = reinterpret_cast<const f16_t*>(x);
    std::function<void()> kernel;
    if (HS == 64 && bf16) kernel = [&] { flash_attention_forward_hs64_bf16(o, l, x, B, T, NH, scale); };
    else if (HS == 64) kernel = [&] { flash_attention_forward_hs64_f16(of, l, xf, B, T, NH, scale); };
    else if (HS == 32 && bf16) kernel = [&] { flash_attention_forward_hs32_bf16(o, l, x, B, T, NH, scale); };
    else if (HS == 32) kernel = [&] { flash_attention_forward_hs32_f16(of, l, xf, B, T, NH, scale); };
    else { std::fprintf(stderr, "HS %d: the kernel takes 32 or 64\n", HS); return 2; }
    emulate::launch(dim3{(unsigned)((T + 63) / 64), (unsigned)(B * NH), 1}, dim3{128, 1, 1}, kernel);
    write_all(argv[7], out);
    write_all(argv[8], lse);
    return 0;
}
