// A behavioural model of the ECP5 TRELLIS_FF, for simulating designs elaborated for an ECP5
// that instantiate it (hbfp.hw.mac_array.ecp5_register): only what those instances use. A D
// flip-flop on the rising edge of CLK with clock enable CE and a synchronous reset LSR to the
// REGSET value; Q starts at that value. It stands in for the cell Yosys keeps as a primitive.
module TRELLIS_FF #(
    parameter GSR = "DISABLED", parameter CEMUX = "CE", parameter CLKMUX = "CLK", parameter LSRMUX = "LSR",
    parameter REGSET = "RESET", parameter SRMODE = "LSR_OVER_CE", parameter LSRMODE = "LSR"
) (
    input CLK, LSR, CE, DI, M,
    output reg Q
);
    localparam INIT = (REGSET == "SET") ? 1'b1 : 1'b0;
    initial Q = INIT;
    always @(posedge CLK) begin
        if (LSR) Q <= INIT;
        else if (CEMUX == "1" || CE) Q <= DI;
    end
endmodule
