// A generic driver for the host emulator: include emulate.hpp, this file and one kernel family's
// source, then EMULATE_ENTRY(name) for each entry point to call. The program reads a plan —
// one item per line — runs one entry point over its grid and writes its buffers back:
//   entry NAME
//   grid X Y Z
//   block X Y Z
//   buf PATH        (a pointer argument: the file's bytes, written back to PATH after the run)
//   same K          (the K-th buf again, 0-based: a kernel that works in place)
//   i32 V | i64 V | f32 V   (a scalar argument)
// Arguments are in the entry point's order; each is passed as the parameter's own type.
#pragma once
#include <deque>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

namespace emulate {
template <class... A, size_t... I>
void call_with(void (*f)(A...), void** args, std::index_sequence<I...>) {
    f(*reinterpret_cast<std::remove_cv_t<A>*>(args[I])...);
}

using Caller = std::function<void(void**, size_t)>;

inline std::map<std::string, Caller>& entries() {
    static std::map<std::string, Caller> registry;
    return registry;
}

template <class... A>
bool add(const char* name, void (*f)(A...)) {
    entries()[name] = [f, name](void** args, size_t n) {
        if (n != sizeof...(A)) {
            std::fprintf(stderr, "%s takes %zu arguments, the plan gives %zu\n", name, sizeof...(A), n);
            std::exit(2);
        }
        call_with(f, args, std::index_sequence_for<A...>{});
    };
    return true;
}

inline int run_plan(const char* path) {
    std::ifstream plan(path);
    if (!plan) { std::fprintf(stderr, "cannot read plan %s\n", path); return 2; }
    std::string entry, line;
    dim3 grid, block;
    std::vector<std::string> paths;
    // 256-byte aligned storage, as the device's allocations are; a buffer may start `shift`
    // bytes in (a view at an odd offset).
    struct alignas(256) Line { unsigned char bytes[256]; };
    std::deque<std::vector<Line>> buffers;
    std::vector<size_t> shifts;
    std::deque<void*> pointers;
    std::deque<int> ints;
    std::deque<long> longs;
    std::deque<float> floats;
    std::vector<void*> args;
    while (std::getline(plan, line)) {
        std::istringstream in(line);
        std::string kind;
        if (!(in >> kind)) continue;
        if (kind == "entry") in >> entry;
        else if (kind == "grid") in >> grid.x >> grid.y >> grid.z;
        else if (kind == "block") in >> block.x >> block.y >> block.z;
        else if (kind == "buf") {
            std::string file;
            size_t shift = 0;
            in >> file >> shift;
            std::ifstream f(file, std::ios::binary);
            std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
            buffers.emplace_back((shift + bytes.size()) / sizeof(Line) + 1);
            unsigned char* start = buffers.back().data()->bytes + shift;
            std::memcpy(start, bytes.data(), bytes.size());
            paths.push_back(file);
            shifts.push_back(shift);
            pointers.push_back(start);
            args.push_back(&pointers.back());
        } else if (kind == "same") {
            size_t k;
            in >> k;
            if (k >= pointers.size()) { std::fprintf(stderr, "plan line `%s`: no buf %zu yet\n", line.c_str(), k); return 2; }
            args.push_back(&pointers[k]);
        } else if (kind == "i32") { ints.emplace_back(); in >> ints.back(); args.push_back(&ints.back()); }
        else if (kind == "i64") { longs.emplace_back(); in >> longs.back(); args.push_back(&longs.back()); }
        else if (kind == "f32") { floats.emplace_back(); in >> floats.back(); args.push_back(&floats.back()); }
        else { std::fprintf(stderr, "plan line `%s`: unknown item\n", line.c_str()); return 2; }
    }
    auto found = entries().find(entry);
    if (found == entries().end()) { std::fprintf(stderr, "no entry point `%s` registered\n", entry.c_str()); return 2; }
    void** argv = args.data();
    const size_t argc = args.size();
    const Caller& call = found->second;
    launch(grid, block, [&] { call(argv, argc); });
    for (size_t i = 0; i < paths.size(); i++) {
        std::ifstream size_of(paths[i], std::ios::binary | std::ios::ate);
        const std::streamsize bytes = size_of.tellg();
        std::ofstream out(paths[i], std::ios::binary | std::ios::trunc);
        out.write(reinterpret_cast<const char*>(buffers[i].data()->bytes + shifts[i]), bytes);
    }
    return 0;
}
}  // namespace emulate

#define EMULATE_ENTRY(name) static const bool registered_##name = emulate::add(#name, name);

int main(int argc, char** argv) {
    if (argc != 2) { std::fprintf(stderr, "usage: %s PLAN\n", argv[0]); return 2; }
    return emulate::run_plan(argv[1]);
}
