// A behavioural model of the ECP5 MULT18X18D, for simulating the MAC array as it is
// elaborated for an ECP5 (hbfp.hw.mac_array.ecp5_multiplier): only what that instance uses.
// The 18x18 multiply, signed or unsigned per SIGNEDA/SIGNEDB, with the A and B input
// registers and the output register each on CLK0 (clock enable CE0, synchronous reset RST0)
// or bypassed ("NONE"); no pipeline register, no C input, no shift chains (Lattice TN1267).
// It stands in for the vendor's cell, which the open tools ship only as a black box.
module MULT18X18D #(
    parameter REG_INPUTA_CLK = "NONE", parameter REG_INPUTB_CLK = "NONE",
    parameter REG_INPUTC_CLK = "NONE", parameter REG_PIPELINE_CLK = "NONE",
    parameter REG_OUTPUT_CLK = "NONE"
) (
    input A0, A1, A2, A3, A4, A5, A6, A7, A8, A9, A10, A11, A12, A13, A14, A15, A16, A17,
    input B0, B1, B2, B3, B4, B5, B6, B7, B8, B9, B10, B11, B12, B13, B14, B15, B16, B17,
    input C0, C1, C2, C3, C4, C5, C6, C7, C8, C9, C10, C11, C12, C13, C14, C15, C16, C17,
    input SIGNEDA, SIGNEDB, SOURCEA, SOURCEB, CLK0, CE0, RST0,
    output P0, P1, P2, P3, P4, P5, P6, P7, P8, P9, P10, P11, P12, P13, P14, P15, P16, P17, P18, P19, P20, P21, P22, P23, P24, P25, P26, P27, P28, P29, P30, P31, P32, P33, P34, P35
);
    wire [17:0] a = {A17, A16, A15, A14, A13, A12, A11, A10, A9, A8, A7, A6, A5, A4, A3, A2, A1, A0};
    wire [17:0] b = {B17, B16, B15, B14, B13, B12, B11, B10, B9, B8, B7, B6, B5, B4, B3, B2, B1, B0};
    reg [17:0] a_q = 18'd0, b_q = 18'd0;
    reg [35:0] p_q = 36'd0;
    always @(posedge CLK0) if (CE0) begin
        a_q <= RST0 ? 18'd0 : a;
        b_q <= RST0 ? 18'd0 : b;
    end
    wire [17:0] a_in = (REG_INPUTA_CLK == "NONE") ? a : a_q;
    wire [17:0] b_in = (REG_INPUTB_CLK == "NONE") ? b : b_q;
    wire signed [36:0] a_x = SIGNEDA ? {{19{a_in[17]}}, a_in} : {19'd0, a_in};
    wire signed [36:0] b_x = SIGNEDB ? {{19{b_in[17]}}, b_in} : {19'd0, b_in};
    wire signed [73:0] full = a_x * b_x;
    wire [35:0] p = full[35:0];
    always @(posedge CLK0) if (CE0) p_q <= RST0 ? 36'd0 : p;
    wire [35:0] p_out = (REG_OUTPUT_CLK == "NONE") ? p : p_q;
    assign {P35, P34, P33, P32, P31, P30, P29, P28, P27, P26, P25, P24, P23, P22, P21, P20, P19, P18, P17, P16, P15, P14, P13, P12, P11, P10, P9, P8, P7, P6, P5, P4, P3, P2, P1, P0} = p_out;
endmodule
