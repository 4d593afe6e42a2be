// Behavioural models of the ECP5 I/O primitives that amaranth.vendor.LatticePlatform's
// get_io_buffer instantiates for io.Buffer and io.DDRBuffer (hbfp.hw.rgmii): IB, OBZ, the
// output-enable flip-flops FD1S3AX and OFS1P3DX, and the DDR registers IDDRX1F and ODDRX1F; and
// the I/O cell's delay DELAYG, which hbfp.hw.rgmii instantiates itself for RGMII's clock-to-data
// delays.
// Written from Lattice's descriptions of the primitives, for simulating what is elaborated for an
// ECP5; they stand in for the vendor's cells, which the open tools ship only as black boxes.
// GSR is not modelled: every register starts at 0, as after configuration.

// Input buffer.
module IB (input I, output O);
    assign O = I;
endmodule

// Output buffer, high impedance while T is high.
module OBZ (input I, input T, output O);
    assign O = T ? 1'bz : I;
endmodule

// A flip-flop on CK's rising edge (the pipeline of a DDR output's enable).
module FD1S3AX (input D, input CK, output reg Q);
    initial Q = 1'b0;
    always @(posedge CK)
        Q <= D;
endmodule

// The I/O cell's output flip-flop: SP enables it, CD clears it asynchronously.
module OFS1P3DX (input D, input SP, input SCLK, input CD, output reg Q);
    initial Q = 1'b0;
    always @(posedge SCLK or posedge CD)
        if (CD)
            Q <= 1'b0;
        else if (SP)
            Q <= D;
endmodule

// DDR input, 1x gearing: D sampled at SCLK's rising edge (Q0) and at the falling edge that
// follows it (Q1), the pair presented together at the next rising edge (so the first bit in
// time is Q0, and both are steady for a whole SCLK cycle).
module IDDRX1F (input D, input SCLK, input RST, output reg Q0, output reg Q1);
    reg rise;  // D at the last rising edge
    reg fall;  // D at the falling edge after it
    initial {rise, fall, Q0, Q1} = 4'b0;
    always @(posedge SCLK or posedge RST)
        if (RST) begin
            rise <= 1'b0;
            Q0 <= 1'b0;
            Q1 <= 1'b0;
        end else begin
            rise <= D;
            Q0 <= rise;
            Q1 <= fall;
        end
    always @(negedge SCLK or posedge RST)
        if (RST)
            fall <= 1'b0;
        else
            fall <= D;
endmodule

// DDR output, 1x gearing: D0 and D1 registered at SCLK's rising edge; Q is D0 while SCLK is
// high and D1 while it is low (D0 first), changing with SCLK's edges. Two pipeline stages come
// before the output stage, as Amaranth's DDRBufferECP5 assumes when it delays the output
// enable to match (two FD1S3AX and an OFS1P3DX): a pair reaches the pin at the third rising
// edge after the one that registered it.
module ODDRX1F (input D0, input D1, input SCLK, input RST, output Q);
    reg d0_1, d1_1, d0_2, d1_2;  // the pipeline stages
    reg high;  // D0 on the pin while SCLK is high
    reg held;  // D1, registered with it, waiting for the falling edge
    reg low;   // D1 on the pin while SCLK is low
    initial {d0_1, d1_1, d0_2, d1_2, high, held, low} = 7'b0;
    always @(posedge SCLK or posedge RST)
        if (RST) begin
            {d0_1, d1_1, d0_2, d1_2, high, held} <= 6'b0;
        end else begin
            {d0_1, d1_1} <= {D0, D1};
            {d0_2, d1_2} <= {d0_1, d1_1};
            {high, held} <= {d0_2, d1_2};
        end
    always @(negedge SCLK or posedge RST)
        if (RST)
            low <= 1'b0;
        else
            low <= held;
    assign Q = SCLK ? high : low;
endmodule

// The I/O cell's fixed delay: Z is A delayed by DEL_VALUE taps of 25 ps (DEL_MODE
// "USER_DEFINED"; the other modes' factory delays are not modelled, DEL_VALUE is taken as given).
// Icarus honours the delay (inertial, as a continuous assignment's: a pulse shorter than the
// delay is lost; RGMII's shortest, at 125 MHz, last 4 ns). Verilator cannot here: the runner
// builds it without --timing, and it then ignores a continuous assignment's delay, so the model
// is plainly a pass-through there. Neither simulator shows the chip's timing: the clocks have no
// clock-network delay in simulation (hbfp.hw.rgmii's docstring).
module DELAYG (input A, output Z);
    parameter DEL_MODE = "USER_DEFINED";
    parameter integer DEL_VALUE = 0;
`ifdef VERILATOR
    assign Z = A;
`else
    assign #(DEL_VALUE * 25ps) Z = A;
`endif
endmodule
