// A behavioural model of the ECP5 CCU2C carry cell, for simulating what is elaborated for an
// ECP5 (hbfp.hw.mac_array.ecp5_cleared_sum). Two halves, each a bit of a carry chain: the half's
// LUT4 (INIT0 / INIT1, indexed by {D, C, B, A}) is the propagate P; the sum is P xor the carry
// into the half; the carry out is the carry in where P is 1, else the generate: the LUT's entry
// for C = D = 0 (INIT[{B, A}]). INJECT1_x "YES" starts the chain at that half: no carry into its
// sum, no generate (Lattice TN1267; tests/test_hw_ecp5_cells.py proves it equal to Yosys' model).
// It stands in for the vendor's cell, which the open tools ship only as a black box.
module CCU2C #(
    parameter [15:0] INIT0 = 16'h0000, parameter [15:0] INIT1 = 16'h0000,
    parameter INJECT1_0 = "YES", parameter INJECT1_1 = "YES"
) (
    input CIN, A0, B0, C0, D0, A1, B1, C1, D1,
    output S0, S1, COUT
);
    wire p0 = INIT0[{D0, C0, B0, A0}];
    wire g0 = (INJECT1_0 == "YES") ? 1'b0 : INIT0[{B0, A0}];
    wire c0 = (INJECT1_0 == "YES") ? 1'b0 : CIN;
    wire cout0 = p0 ? CIN : g0;
    wire p1 = INIT1[{D1, C1, B1, A1}];
    wire g1 = (INJECT1_1 == "YES") ? 1'b0 : INIT1[{B1, A1}];
    wire c1 = (INJECT1_1 == "YES") ? 1'b0 : cout0;
    assign S0 = p0 ^ c0;
    assign S1 = p1 ^ c1;
    assign COUT = p1 ? cout0 : g1;
endmodule
