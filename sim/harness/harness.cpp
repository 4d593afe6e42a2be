// The `sim` backend's native half: a Verilated accelerator top driven through its byte
// streams from a C API that Python loads with ctypes (sim/device.py).
//
// Python never runs per clock edge. It appends bytes to an input queue (hbfp_write), asks for
// a number of cycles with a stop condition (hbfp_run), and takes bytes from an output queue
// (hbfp_read). Inside hbfp_run a loop toggles the clock, feeds the `i` stream from the input
// queue whenever the device is ready, drains the `o` stream into the output queue, and stops
// on the first stop condition that holds: a complete reply frame buffered, any byte buffered,
// the input queue accepted, the device idle for a given number of cycles, or nothing left to
// happen without the host (queue taken, every whole request answered).
//
// The model is the wrapper of sim/harness/build.py (`wrapper_verilog`): the top with its reset
// from a power-on counter, so a reset is a new model, and its streams (optionally) behind
// 2-entry FIFOs.
//
// Build-time macros (sim/harness/build.py passes them):
//   HBFP_STREAM_BYTES  lanes of the `i` and `o` streams (payload: data bytes, lane 0 in the
//                      low bits, then one keep bit per lane)
//   HBFP_RESET_CYCLES  cycles the wrapper holds the top in reset after the model is created
//
// Frames (docs/protocol.md) are tracked only to know when a reply is complete and how many
// requests still await one: magic "HB", 8 more header bytes whose last 4 are the payload
// length, the payload, and a 4-byte CRC.

#include "Vtop.h"
#include "verilated.h"

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#ifndef HBFP_STREAM_BYTES
#define HBFP_STREAM_BYTES 1
#endif
#ifndef HBFP_RESET_CYCLES
#define HBFP_RESET_CYCLES 8
#endif

#define HBFP_API extern "C" __attribute__((visibility("default")))

// The streams' ports. Verilator escapes the "__" of Amaranth's flattened names as "___05F".
#define I_VALID i___05Fvalid
#define I_READY i___05Fready
#define I_PAYLOAD i___05Fpayload
#define O_VALID o___05Fvalid
#define O_READY o___05Fready
#define O_PAYLOAD o___05Fpayload

namespace {

constexpr int SB = HBFP_STREAM_BYTES;
constexpr int PAYLOAD_WORDS = (9 * SB + 31) / 32;
constexpr int HEADER_SIZE = 10;
constexpr int CRC_SIZE = 4;

// Stop conditions of hbfp_run (a bit set; the run also ends after max_cycles).
enum : uint32_t {
    STOP_FRAME = 1,   // a complete frame is buffered beyond the read position
    STOP_OUTPUT = 2,  // any output byte is buffered
    STOP_DRAINED = 4, // the input queue is empty (every byte accepted by the device)
    STOP_IDLE = 8,    // input queue empty and no beat moved on either stream for idle_cycles
    STOP_WAITING = 16, // input queue empty and every complete request taken has its reply:
                       // nothing more happens until the host writes
};

// The payload signals are CData/SData/IData/QData up to 64 bits and VlWide<N> above.
template <typename T>
inline void set_payload(T& sig, const uint32_t* w) {
    uint64_t v = w[0];
    if constexpr (PAYLOAD_WORDS > 1) v |= static_cast<uint64_t>(w[1]) << 32;
    sig = static_cast<T>(v);
}
template <std::size_t N>
inline void set_payload(VlWide<N>& sig, const uint32_t* w) {
    for (std::size_t k = 0; k < N; k++) sig[k] = w[k];
}
template <typename T>
inline void get_payload(const T& sig, uint32_t* w) {
    uint64_t v = static_cast<uint64_t>(sig);
    w[0] = static_cast<uint32_t>(v);
    if constexpr (PAYLOAD_WORDS > 1) w[1] = static_cast<uint32_t>(v >> 32);
}
template <std::size_t N>
inline void get_payload(const VlWide<N>& sig, uint32_t* w) {
    for (std::size_t k = 0; k < N; k++) w[k] = sig[k];
}
inline unsigned get_bits(const uint32_t* w, int lsb, int n) {
    uint64_t lo = w[lsb / 32];
    if ((lsb % 32) + n > 32) lo |= static_cast<uint64_t>(w[lsb / 32 + 1]) << 32;
    return static_cast<unsigned>((lo >> (lsb % 32)) & ((1u << n) - 1));
}
inline void set_bits(uint32_t* w, int lsb, int n, unsigned v) {
    uint64_t x = static_cast<uint64_t>(v) << (lsb % 32);
    w[lsb / 32] |= static_cast<uint32_t>(x);
    if ((lsb % 32) + n > 32) w[lsb / 32 + 1] |= static_cast<uint32_t>(x >> 32);
}

// Follows a byte stream frame by frame (magic, header, payload, CRC), without checking CRCs.
struct FrameScanner {
    int state = 0;      // 0: hunting 'H', 1: seen 'H', 2: header, 3: body
    int header_got = 0;
    uint8_t header[HEADER_SIZE] = {};
    uint64_t body_left = 0;
    uint64_t body_got = 0;
    uint8_t first_body_byte = 0;  // a reply's status
    uint64_t started = 0;   // frames whose magic has been seen
    uint64_t completed = 0; // frames whose last byte has been seen

    // True when `b` completes a frame.
    bool feed(uint8_t b) {
        switch (state) {
        case 0:
            if (b == 'H') state = 1;
            return false;
        case 1:
            if (b == 'B') {
                state = 2;
                header[0] = 'H';
                header[1] = 'B';
                header_got = 2;
                started++;
            } else if (b != 'H') {
                state = 0;
            }
            return false;
        case 2:
            header[header_got++] = b;
            if (header_got == HEADER_SIZE) {
                uint32_t length;
                std::memcpy(&length, header + 6, 4);  // little-endian host
                body_left = static_cast<uint64_t>(length) + CRC_SIZE;
                body_got = 0;
                state = 3;
            }
            return false;
        default:
            if (body_got++ == 0) first_body_byte = b;
            if (--body_left == 0) {
                state = 0;
                completed++;
                return true;
            }
            return false;
        }
    }
    bool mid_frame() const { return state >= 2; }
    void resync() { state = 0; header_got = 0; body_left = 0; }
    uint16_t tag() const { return static_cast<uint16_t>(header[4] | header[5] << 8); }
    // The frame just completed is a TIMEOUT reply (docs/protocol.md: status 7, tag 0xFFFF).
    bool timeout_reply() const { return tag() == 0xFFFF && first_body_byte == 7; }
};

struct Lfsr {
    uint32_t s = 0xACE1u;
    // A pseudo-random byte per call (xorshift32).
    unsigned next() {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        return s & 0xFF;
    }
};

struct Sim {
    VerilatedContext* ctx = nullptr;
    Vtop* top = nullptr;

    std::vector<uint8_t> in;  // bytes not yet accepted by the device, from in_head on
    std::size_t in_head = 0;
    int beat_bytes = 0;        // bytes of the beat presented on `i` (0: i__valid low)

    std::vector<uint8_t> out;  // bytes from the device not yet read, from out_head on
    std::size_t out_head = 0;
    uint64_t out_total = 0;    // bytes ever received
    uint64_t out_read = 0;     // bytes ever read by the host
    uint64_t frame_end = 0;    // out_total at the end of the last complete frame

    FrameScanner in_frames, out_frames;
    uint64_t cycles = 0;
    // Cycles the link is occupied by an exchange: from the cycle a request's first beat is
    // offered to the one its reply's last beat is taken, whenever a request byte is queued
    // or in flight, a frame is part-way in either direction, or a request awaits its reply
    // (the device computing, or making the link wait, included); not while the host idles.
    uint64_t wire_cycles = 0;
    uint64_t in_beats = 0, out_beats = 0;

    // Throttling for tests: the chance (of 256) that a new input beat is offered in a cycle,
    // and that o__ready is high in a cycle. 256: always.
    unsigned in_chance = 256, out_chance = 256;
    Lfsr lfsr;

    Sim() = default;
    ~Sim() { destroy(); }

    void construct() {
        ctx = new VerilatedContext;
        ctx->fatalOnError(false);
        top = new Vtop{ctx, "top"};
        top->clk = 0;
        top->I_VALID = 0;
        top->O_READY = 0;
        top->eval();
    }
    void destroy() {
        if (top) {
            top->final();
            delete top;
            top = nullptr;
        }
        delete ctx;
        ctx = nullptr;
    }

    void clear_queues() {
        in.clear();
        in_head = 0;
        beat_bytes = 0;
        out.clear();
        out_head = 0;
        out_total = out_read = frame_end = 0;
        in_frames = FrameScanner{};
        out_frames = FrameScanner{};
        in_beats = out_beats = 0;
        wire_cycles = 0;
    }

    // Puts the next input beat (or none) on `i`; keeps a beat already offered until taken,
    // as a stream transmitter must.
    void present() {
        if (beat_bytes == 0) {
            std::size_t avail = in.size() - in_head;
            if (avail && (in_chance >= 256 || lfsr.next() < in_chance)) {
                int n = avail < static_cast<std::size_t>(SB) ? static_cast<int>(avail) : SB;
                uint32_t w[PAYLOAD_WORDS] = {};
                for (int k = 0; k < n; k++) set_bits(w, 8 * k, 8, in[in_head + k]);
                set_bits(w, 8 * SB, SB, (1u << n) - 1);
                set_payload(top->I_PAYLOAD, w);
                beat_bytes = n;
                top->I_VALID = 1;
            } else {
                top->I_VALID = 0;
            }
        }
        top->O_READY = (out_chance >= 256 || lfsr.next() < out_chance) ? 1 : 0;
    }

    void take_output_beat() {
        uint32_t w[PAYLOAD_WORDS];
        get_payload(top->O_PAYLOAD, w);
        unsigned keep = get_bits(w, 8 * SB, SB);
        for (int k = 0; k < SB; k++) {
            if (!(keep >> k & 1)) continue;
            uint8_t b = static_cast<uint8_t>(get_bits(w, 8 * k, 8));
            out.push_back(b);
            out_total++;
            if (out_frames.feed(b)) {
                frame_end = out_total;
                // The device dropped a frame that stopped arriving: so does our count of
                // requests, where the dropped frame now counts as one answered.
                if (out_frames.timeout_reply()) {
                    in_frames.resync();
                    in_frames.completed++;
                }
            }
        }
        out_beats++;
    }

    void tick() {
        top->clk = 1;
        top->eval();
        top->clk = 0;
        top->eval();
    }

    // A new model, held in reset by the wrapper for its first HBFP_RESET_CYCLES cycles (and
    // at least `reset_cycles`), with both queues empty; the cycle count starts after it.
    void reset(int reset_cycles) {
        destroy();
        construct();
        clear_queues();
        int n = reset_cycles > HBFP_RESET_CYCLES ? reset_cycles : HBFP_RESET_CYCLES;
        for (int k = 0; k < n + 1; k++) tick();
        cycles = 0;
        present();
        top->eval();
    }

    // One clock cycle. Before the edge the model is settled with this cycle's inputs, so the
    // handshakes seen now are the transfers that the rising edge performs.
    bool exchange_open() const {
        return in_head < in.size() || beat_bytes != 0 || in_frames.mid_frame() || out_frames.mid_frame() ||
               out_frames.completed < in_frames.completed;
    }

    inline bool cycle() {
        if (exchange_open()) wire_cycles++;
        bool in_fire = top->I_VALID && top->I_READY;
        bool out_fire = top->O_VALID && top->O_READY;
        if (out_fire) take_output_beat();  // the payload before the edge is the one transferred
        top->clk = 1;
        top->eval();
        cycles++;
        if (in_fire) {
            for (int k = 0; k < beat_bytes; k++) in_frames.feed(in[in_head + k]);
            in_head += beat_bytes;
            beat_bytes = 0;
            in_beats++;
        }
        present();
        top->clk = 0;
        top->eval();
        return in_fire || out_fire;
    }

    uint64_t run(uint64_t max_cycles, uint32_t stop, uint64_t idle_cycles) {
        uint64_t n = 0, quiet = 0;
        while (n < max_cycles) {
            if ((stop & STOP_FRAME) && frame_end > out_read) break;
            if ((stop & STOP_OUTPUT) && out_total > out_read) break;
            bool drained = in_head == in.size();
            if ((stop & STOP_DRAINED) && drained) break;
            if ((stop & STOP_IDLE) && drained && quiet >= idle_cycles) break;
            if ((stop & STOP_WAITING) && drained && beat_bytes == 0 &&
                out_frames.completed >= in_frames.completed)
                break;
            if (cycle()) quiet = 0;
            else quiet++;
            n++;
            if (ctx->gotFinish()) break;
        }
        // Keep the queues compact: drop consumed bytes once they are the larger part.
        if (in_head > 4096 && in_head * 2 > in.size()) {
            in.erase(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(in_head));
            in_head = 0;
        }
        return n;
    }
};

}  // namespace

HBFP_API uint32_t hbfp_abi(void) { return (1u << 16) | 1u; }  // 1.1: counter 10, wire cycles
HBFP_API int hbfp_stream_bytes(void) { return SB; }

HBFP_API void* hbfp_new(int reset_cycles) {
    Sim* s = new Sim;
    s->reset(reset_cycles);
    return s;
}

HBFP_API void hbfp_free(void* p) { delete static_cast<Sim*>(p); }

// The device after a power-on reset: a new model (memories at their initial contents), both
// queues empty, the cycle count at 0.
HBFP_API void hbfp_reset(void* p, int reset_cycles) { static_cast<Sim*>(p)->reset(reset_cycles); }

HBFP_API int64_t hbfp_write(void* p, const uint8_t* data, int64_t n) {
    Sim* s = static_cast<Sim*>(p);
    s->in.insert(s->in.end(), data, data + n);
    return n;
}

HBFP_API int64_t hbfp_read(void* p, uint8_t* data, int64_t max) {
    Sim* s = static_cast<Sim*>(p);
    std::size_t avail = s->out.size() - s->out_head;
    std::size_t n = static_cast<std::size_t>(max) < avail ? static_cast<std::size_t>(max) : avail;
    if (n) std::memcpy(data, s->out.data() + s->out_head, n);
    s->out_head += n;
    s->out_read += n;
    if (s->out_head == s->out.size()) {
        s->out.clear();
        s->out_head = 0;
    } else if (s->out_head > 4096 && s->out_head * 2 > s->out.size()) {
        s->out.erase(s->out.begin(), s->out.begin() + static_cast<std::ptrdiff_t>(s->out_head));
        s->out_head = 0;
    }
    return static_cast<int64_t>(n);
}

HBFP_API uint64_t hbfp_run(void* p, uint64_t max_cycles, uint32_t stop, uint64_t idle_cycles) {
    return static_cast<Sim*>(p)->run(max_cycles, stop, idle_cycles);
}

HBFP_API void hbfp_set_throttle(void* p, uint32_t in_chance, uint32_t out_chance, uint32_t seed) {
    Sim* s = static_cast<Sim*>(p);
    s->in_chance = in_chance;
    s->out_chance = out_chance;
    s->lfsr.s = seed ? seed : 0xACE1u;
}

// Counters, in the order of enum Counter in sim/device.py.
HBFP_API void hbfp_counters(void* p, uint64_t* c) {
    Sim* s = static_cast<Sim*>(p);
    c[0] = s->cycles;
    c[1] = s->in.size() - s->in_head;             // input bytes not yet accepted
    c[2] = s->out.size() - s->out_head;           // output bytes buffered
    c[3] = s->frame_end > s->out_read;            // a complete frame is buffered
    c[4] = s->in_frames.completed;                // request frames the device took whole
    c[5] = s->in_frames.mid_frame();              // the device has taken part of a frame
    c[6] = s->out_frames.completed;               // reply frames received
    c[7] = s->in_beats;
    c[8] = s->out_beats;
    c[9] = s->ctx->gotFinish();
    c[10] = s->wire_cycles;                       // cycles an exchange occupied the link
}
