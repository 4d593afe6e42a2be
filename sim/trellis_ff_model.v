// A behavioural model of the ECP5 TRELLIS_FF, for simulating what is elaborated for an ECP5
// (hbfp.hw.mac_array.control_register): only what that instance uses. A flip-flop on CLK
// (CLKMUX "CLK") whose LSR (LSRMUX "LSR") resets it synchronously (SRMODE "LSR_OVER_CE") to
// 0 (REGSET "RESET") or 1 ("SET"), enabled always (CEMUX "1") or by CE ("CE"); GSR unused.
// It stands in for the vendor's cell, which the open tools ship only as a black box.
module TRELLIS_FF #(
    parameter GSR = "DISABLED", parameter CEMUX = "1", parameter CLKMUX = "CLK",
    parameter LSRMUX = "LSR", parameter SRMODE = "LSR_OVER_CE", parameter REGSET = "RESET"
) (
    input CLK, LSR, CE, DI, M,
    output reg Q
);
    wire enabled = (CEMUX == "1") ? 1'b1 : CE;
    initial Q = (REGSET == "SET") ? 1'b1 : 1'b0;
    always @(posedge CLK)
        if (LSR)
            Q <= (REGSET == "SET") ? 1'b1 : 1'b0;
        else if (enabled)
            Q <= DI;
endmodule
